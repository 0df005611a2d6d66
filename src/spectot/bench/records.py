"""Benchmark records: one JSON line per finished measurement, keyed by the run's configuration,
so an interrupted benchmark resumes where it stopped and a changed configuration starts afresh.

A configuration is what the flags say and what they name: ``run_identity`` adds the content of every file or
folder a flag names (a data file edited, a draft retrained in the same folder: not the same run; also a path
inside an ``--ablation NAME=FOLDER`` value), the machine (its CPU model and threads, the GPU: timings from another
machine are not reused) and spectot's own code and shipped drafts (``code_id``: a record measured before a change
to the engine is not mixed with one after it; the version number alone never changed). A run killed while
appending leaves a torn last line: it is cut off, and that measurement is made again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import platform
import re
from pathlib import Path
from typing import Any

import torch

from spectot.data.jsonl import DataError, appended_lines, drop_torn_line

logger = logging.getLogger(__name__)

LARGE_FILE = 256 * 2**20  # bytes: a larger file is identified by its size and modification time, not read


def machine_info() -> dict:
    """Where a benchmark ran: the OS, the CPU model, torch, its CPU threads and the CUDA GPU if torch sees one."""
    info = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (a virtual machine may name every EPYC alike:
    'AMD EPYC (family 25 model 17)' is a Zen 4); ``platform.processor()`` where /proc/cpuinfo is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def code_id() -> str:
    """A digest of spectot's installed package: its code, kernels' sources and shipped drafts (compiled
    ``__pycache__`` files left out: they appear as modules are first imported)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.blake2b(digest_size=12)
    for file in sorted(package.rglob("*")):
        if file.is_file() and "__pycache__" not in file.parts:
            digest.update(str(file.relative_to(package)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def content_id(path: str | Path) -> str:
    """A short digest of a file's bytes, or of a folder's files (names and bytes, in name order)."""
    path = Path(path)
    digest = hashlib.blake2b(digest_size=12)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        stat = file.stat()
        if stat.st_size > LARGE_FILE:
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
            continue
        with file.open("rb") as f:
            for block in iter(lambda: f.read(2**20), b""):
                digest.update(block)
    return digest.hexdigest()


def run_identity(options: dict[str, Any], outputs: tuple[str, ...] = ("out",)) -> dict[str, Any]:
    """The identity of a run: its options, the content of each file or folder an option names (but the
    ``outputs``: the folder the records go to), the machine and spectot's version."""
    inputs = {
        f"{name}:{path}" if path != value else name: content_id(path)
        for name, value in options.items()
        if name not in outputs
        for path in _named_paths(value)
    }
    return {**options, "inputs": inputs, "machine": machine_info(), "spectot": _version(), "code": code_id()}


def _named_paths(value: Any) -> list[str]:
    """The existing files or folders an option's value names: itself, an item of a list, or a part of an
    ``--ablation`` entry ('edd_ce=runs/edd-ce,num_draft_tokens=4' names runs/edd-ce)."""
    if isinstance(value, (list, tuple)):
        return [path for item in value for path in _named_paths(item)]
    if not isinstance(value, str) or not value:
        return []
    parts = [value] if Path(value).exists() else [p for p in re.split(r"[=,]", value) if p and Path(p).exists()]
    return list(dict.fromkeys(parts))


def load_records(path: Path, config: dict) -> dict[tuple, dict]:
    """The records of ``config`` in ``path``; a torn last line (a kill mid-append) is cut off, any other line that
    is not a record is a DataError naming it, and records of other configurations are left (and counted in a
    warning)."""
    if not path.exists():
        return {}
    lines, torn = appended_lines(path)
    stored = json.loads(json.dumps(config))  # as written: tuples come back as lists
    records, others = {}, 0
    for number, line in enumerate(lines, start=1):
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise DataError(
                f"{path}:{number}: not a JSON line of benchmark records; use another output folder"
            ) from None
        mine = isinstance(rec, dict) and rec.get("config") == stored and isinstance(rec.get("key"), list)
        if mine and "value" in rec:
            records[tuple(rec["key"])] = rec["value"]
        else:
            others += 1  # another configuration's, or an older spectot's format
    if torn:  # cut only once the file is known to be records: another file named so keeps every byte
        logger.warning("%s: the last record was cut short (the run was killed): it is measured again", path)
        drop_torn_line(path, torn)
    if others:
        logger.warning(
            "%s: %d record(s) of another configuration (flags, files, machine or version differ) are not reused",
            path,
            others,
        )
    return records


def append_record(path: Path, config: dict, key: tuple, value: dict, records: dict[tuple, dict]) -> None:
    if key in records:
        return
    records[key] = value
    with path.open("a") as f:
        f.write(json.dumps({"config": config, "key": list(key), "value": value}) + "\n")


def _version() -> str:
    try:
        return importlib.metadata.version("spectot")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def refuse_failures(records: list[dict], what: str) -> None:
    """A benchmark compares work that ran: a problem that failed alone (a prompt past the context: its record's
    ``error``, graded 0, seconds short) would count as a fast wrong answer on every side, so it ends the run."""
    failed = [r for r in records if r.get("error")]
    if failed:
        first = failed[0]
        raise ValueError(
            f"{what}: {len(failed)} problem(s) failed ({', '.join(str(r['id']) for r in failed[:5])}; problem "
            f"{first['id']}: {first['error']}); run fewer --problems or a data file without them"
        )
