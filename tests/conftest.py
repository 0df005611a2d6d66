"""Shared fixtures: tiny randomly initialised causal LMs of each supported family, built from config.

Every model is fp32, in eval mode, and built under a fixed seed, so a (family, seed, overrides)
triple always names the same weights; models are cached for the session (nothing mutates them).

SPECTOT_TEST_DEVICE=cuda puts the tiny models on that device (`scripts/gpu_bench.sh tests`); checkpoints loaded
by path follow ModelOptions' --device default ('auto': the GPU where torch sees one).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# family -> (config class, model class, family-specific defaults)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # Mistral defaults to a 4096-token sliding window; None makes it plain full attention.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    # Qwen3 normalises q and k per head; its head_dim defaults to 128, not hidden / heads.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
}


def build_tiny_model(family: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny fp32 model of ``family`` whose weights depend only on ``seed`` and the config."""
    config_cls, model_cls, defaults = FAMILIES[family]
    config = config_cls(**{**TINY, **defaults, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float().eval().to(os.environ.get("SPECTOT_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., PreTrainedModel]:
    """Factory ``tiny_model(family, seed=0, **config_overrides)``, cached per argument set."""
    return functools.cache(build_tiny_model)


@pytest.fixture(scope="session")
def tiny_llama(tiny_model) -> Callable[..., PreTrainedModel]:
    """Factory ``tiny_llama(seed=0, **config_overrides)``."""
    return functools.partial(tiny_model, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model) -> Callable[..., PreTrainedModel]:
    return functools.partial(tiny_model, "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model) -> Callable[..., PreTrainedModel]:
    return functools.partial(tiny_model, "mistral")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one thread (intra-op threads only add overhead at this size)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY_WORDS = ["<unk>", "<s>", "</s>", "<eot>"] + [f"w{i}" for i in range(60)]


def build_tiny_tokenizer():
    """A word-level tokenizer over the tiny models' 64 ids: "w5 w6" -> [9, 10]; <eot> (3) ends a turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="<eot>")


def build_metaspace_tokenizer():
    """The tiny tokenizer's ids as a SentencePiece (Metaspace) tokenizer spells them, as Llama-2's and Mistral's
    do: "w5 w6" -> [9, 10] (pieces "▁w5", "▁w6"), and the text's first piece decodes without its space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = TINY_WORDS[:4] + ["\u2581" + w for w in TINY_WORDS[4:]]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(pieces)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="<eot>")


@pytest.fixture(scope="session")
def metaspace_checkpoint(tmp_path_factory, tiny_model) -> Path:
    """The tiny Llama with the Metaspace tokenizer (``build_metaspace_tokenizer``)."""
    path = tmp_path_factory.mktemp("tiny-llama-metaspace")
    tiny_model("llama", 0).save_pretrained(path)
    build_metaspace_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_model) -> Path:
    """A saved tiny Llama with its word-level tokenizer, loadable by path like any checkpoint."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", 0).save_pretrained(path)  # from any device (Module.cpu() would move the shared model)
    build_tiny_tokenizer().save_pretrained(path)
    return path
