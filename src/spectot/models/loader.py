"""Loading a causal LM and its tokenizer, and refusing what the engine cannot run exactly.

The engine runs its own attention over a flat KV cache (``engine/runner.py``) on top of the
checkpoint's projection, norm, MLP and rotary modules, so it supports the families whose decoder
layer it knows: Llama (SmolLM2), Mistral, Qwen2, Qwen3. Sliding-window models are run only while
every sequence fits inside the window, where sliding and full attention agree; linear-attention
and other recurrent caches cannot be rolled back and are refused.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from spectot.models.registry import ALIASES, convert_gguf, find_alias, gguf_cache_path, materialize_alias

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DType = Literal["bf16", "fp32", "fp16"]
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class ModelLoadError(ValueError):
    """A model or tokenizer that spectot cannot load or cannot run losslessly."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    max_context: int  # tokens a stream may hold (the window for sliding-window models)
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])


def torch_dtype(dtype: DType) -> torch.dtype:
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    if dtype not in dtypes:  # a KeyError inside the load read as a broken checkpoint ("delete the cache")
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    return dtypes[dtype]


def _rope_types(config: Any) -> set[str]:
    """The RoPE types a config declares (transformers 5's ``rope_parameters``, flat or per layer type, or the older
    ``rope_scaling``)."""
    declared = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(declared, dict):
        return set()
    tables = [t for t in declared.values() if isinstance(t, dict)] or [declared]
    return {str(t.get("rope_type", t.get("type", "default"))) for t in tables}


def check_architecture(config: Any) -> int:
    """Raise ModelLoadError for architectures the engine cannot run exactly; return the max context."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ModelLoadError(
            f"model type '{family}' is not supported by the spectot engine; supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types - {"full_attention", "sliding_attention"}:
        raise ModelLoadError(
            f"layer types {sorted(layer_types)} include a linear-attention or recurrent cache that cannot be "
            "rolled back after a rejected draft; spectot refuses it rather than give wrong output"
        )
    if "longrope" in _rope_types(config):
        raise ModelLoadError(
            "LongRoPE picks its frequencies by the longest position of each forward: a stream's tokens would depend "
            "on the streams verified beside it (and a tree forward on its deepest row); spectot refuses it rather "
            "than give wrong output"
        )
    max_context = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in layer_types or (
        window is not None and getattr(config, "use_sliding_window", family == "mistral")
    )
    if sliding and window:
        logger.warning(
            "sliding-window attention (window %d): sequences are limited to the window, where it equals "
            "full attention and rollback is exact",
            window,
        )
        max_context = min(max_context, int(window))
    return max_context


def resolve_checkpoint(name_or_path: str) -> Path | str:
    """An alias's checkpoint folder, a local folder, or a hub id ("org/name"); a name that can be neither (a
    path that does not exist, a bare word that is no alias) is an error at once, not minutes of hub retries."""
    alias = find_alias(name_or_path)
    if alias is not None and Path(name_or_path).exists():  # the alias won in silence over the user's folder
        raise ModelLoadError(
            f"'{name_or_path}' names both a built-in model and a path here: pass ./{name_or_path} for the path, or "
            "run from another folder for the built-in one"
        )
    if alias is not None:
        return materialize_alias(alias)
    path = Path(name_or_path).expanduser()
    if path.exists():
        ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
        if path.is_file() and path.suffix == ".gguf" or len(ggufs) == 1:  # converted once into the cache
            gguf = path if path.is_file() else ggufs[0]
            return convert_gguf(gguf, gguf_cache_path(gguf))
        if not (path / "config.json").exists():
            found = f" and {len(ggufs)} GGUF files (pass one)" if ggufs else ""
            raise ModelLoadError(
                f"{path} has no config.json{found}: pass a Hugging Face checkpoint folder or a .gguf file"
            )
        return path
    if not looks_like_hub_id(name_or_path):
        aliases = ", ".join(a.name for a in ALIASES)
        raise ModelLoadError(
            f"'{name_or_path}': no such folder, and neither an alias ({aliases}) nor a hub id (org/name)"
        )
    return name_or_path


def hub_cached(repo_id: str) -> bool:
    """Whether the hub checkpoint's config is in the local Hugging Face cache (it loads without the network)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub (``HF_ENDPOINT``) answers a TCP connect within ``timeout`` s; False when offline mode is
    set. An unreachable hub fails in seconds here instead of after the client's retries (~25 s)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def looks_like_hub_id(name: str) -> bool:
    """A Hugging Face hub repository id as the hub names them: "org/name" (one slash, no path prefix)."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith((".", "~"))


def resolve_device(device: str) -> str:
    """'auto' -> the first CUDA GPU torch sees, else 'cpu'; any other name must be usable here."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device}: torch sees no CUDA GPU here (torch {torch.__version__}); use cpu")
    if kind == "cuda" and ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        raise ModelLoadError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def load_model(name_or_path: str, dtype: DType = "bf16", device: str = "cpu") -> LoadedModel:
    """Load a causal LM by alias, local path or hub id, in eval mode, on ``device`` ('auto' allowed)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    weights_dtype = torch_dtype(dtype)  # before the load: a bad name is no broken checkpoint

    source = resolve_checkpoint(name_or_path)
    try:
        if isinstance(source, str) and not hub_cached(source) and not hub_reachable():
            raise OSError("the hub cannot be reached and the checkpoint is not in the local cache")
        config = AutoConfig.from_pretrained(source)
    except OSError as err:
        if isinstance(source, Path):
            raise
        offline = (
            "this machine may be offline: download the checkpoint elsewhere and pass its local folder path, or use "
            "an alias from `spectot models`"
            if not hub_reachable()
            else "is the id right (a missing or gated repository), or a local folder mistyped?"
        )
        raise ModelLoadError(
            f"could not load '{name_or_path}' from the Hugging Face hub ({type(err).__name__}: {err}; there is no "
            f"local folder of that name either); {offline}"
        ) from err
    max_context = check_architecture(config)
    cure = (
        f"delete {source} and load the alias again to rebuild it"
        if find_alias(name_or_path) is not None
        else "is the checkpoint complete?"
    )
    try:  # the tokenizer first: a missing one is found before the weights' load
        tokenizer = AutoTokenizer.from_pretrained(source)
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=weights_dtype, output_loading_info=True)
    except Exception as err:  # a truncated safetensors file (SafetensorError), a tokenizer file missing
        raise ModelLoadError(f"{source}: cannot load the checkpoint ({type(err).__name__}: {err}); {cure}") from None
    absent = [
        *info.get("missing_keys", ()),
        *(str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys", ())),
    ]
    if absent:  # transformers fills them with random values, and warns where nobody reads it
        shown = ", ".join(sorted(absent)[:4]) + (", ..." if len(absent) > 4 else "")
        raise ModelLoadError(
            f"{source}: the checkpoint lacks {len(absent)} weight(s) of its architecture ({shown}); {cure}"
        )
    unread = sorted(str(k) for k in info.get("unexpected_keys", ()))
    if unread:  # e.g. a config.json declaring fewer layers than its weights hold: those layers are dropped
        shown = ", ".join(unread[:4]) + (", ..." if len(unread) > 4 else "")
        logger.warning(
            "%s: the checkpoint holds %d weight(s) its architecture does not read (%s): is config.json that of these "
            "weights?",
            source,
            len(unread),
            shown,
        )
    model = model.to(device).eval()  # out of memory here is not a broken checkpoint: it surfaces as it is
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name_or_path,
        max_context=max_context,
        eos_token_ids=eos_ids(model, tokenizer),
    )


def eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's tokens: same vocabulary, same ids."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        differ = sum(1 for tok, i in t_vocab.items() if d_vocab.get(tok) != i)
        raise ModelLoadError(
            f"draft '{draft.name}' and target '{target.name}' have different tokenizers ({len(d_vocab)} vs "
            f"{len(t_vocab)} tokens, {differ} target tokens missing or renumbered in the draft): a draft must use "
            "the target's tokenizer; try `--draft ngram`"
        )
    tokens = real_tokens(target)
    if min(draft.vocab_size, target.vocab_size) < tokens:
        raise ModelLoadError(
            f"draft LM head has {draft.vocab_size} rows and the target's {target.vocab_size}, but the tokenizer has "
            f"{tokens} tokens: the logits do not line up; use a draft trained for this target"
        )


def real_tokens(model: LoadedModel) -> int:
    """The ids that are tokens (the tokenizer's, added ones included); an LM head may be padded past them."""
    return max(model.tokenizer.get_vocab().values()) + 1


def chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The ids a chat model is fed for ``messages``: its chat template with the generation prompt added. A template's
    own refusal (jinja2's ``raise_exception``: roles must alternate, a system message required) is a ValueError
    naming the template, which the callers name the prompt or the line of."""
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except TemplateError as err:
        raise ValueError(f"the chat template refused the prompt: {err}") from err
    return list(out["input_ids"])
