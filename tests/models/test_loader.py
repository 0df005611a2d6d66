"""Model loading: local checkpoints, offline hub ids, architecture checks and draft/target vocabulary checks."""

from __future__ import annotations

import types

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, PreTrainedTokenizerFast, Qwen2Config

from spectot.models.loader import (
    LoadedModel,
    ModelLoadError,
    check_architecture,
    check_same_vocabulary,
    eos_ids,
    load_model,
)

WORDS = ["<unk>", "<s>", "</s>", "<eot>"] + [f"w{i}" for i in range(60)]  # 64 tokens, as the tiny models


def word_tokenizer(words: list[str] = WORDS) -> PreTrainedTokenizerFast:
    """An in-memory word-level tokenizer: token i is words[i]."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="<eot>")


def loaded(model, tokenizer, name: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, max_context=2048, eos_token_ids=(3,))


# -- check_same_vocabulary -----------------------------------------------------------------------


def test_same_vocabulary_and_head_is_accepted(tiny_llama) -> None:
    check_same_vocabulary(loaded(tiny_llama(0), word_tokenizer(), "t"), loaded(tiny_llama(1), word_tokenizer(), "d"))


def test_draft_with_renumbered_tokens_is_refused(tiny_llama) -> None:
    swapped = WORDS[:4] + [WORDS[5], WORDS[4]] + WORDS[6:]  # same tokens, two ids swapped
    target = loaded(tiny_llama(0), word_tokenizer(), "target-model")
    draft = loaded(tiny_llama(1), word_tokenizer(swapped), "draft-model")
    with pytest.raises(ModelLoadError, match="different tokenizers") as err:
        check_same_vocabulary(target, draft)
    message = str(err.value)
    assert "draft-model" in message and "target-model" in message
    assert "2 target tokens missing or renumbered" in message


def test_draft_with_other_tokens_is_refused(tiny_llama) -> None:
    other = WORDS[:-1] + ["zzz"]
    target = loaded(tiny_llama(0), word_tokenizer(), "t")
    draft = loaded(tiny_llama(1), word_tokenizer(other), "d")
    with pytest.raises(ModelLoadError, match="1 target tokens missing or renumbered"):
        check_same_vocabulary(target, draft)


def test_a_draft_with_a_padded_head_pairs_and_one_too_small_is_refused(tiny_llama) -> None:
    """One tokenizer, heads padded to different widths (Qwen2.5 0.5B / 7B): they pair; a head with fewer rows
    than the tokenizer has tokens cannot."""
    target = loaded(tiny_llama(0), word_tokenizer(), "t")
    padded = loaded(tiny_llama(1, vocab_size=72), word_tokenizer(), "d")
    assert padded.vocab_size == 72 and target.vocab_size == 64
    check_same_vocabulary(target, padded)
    small = loaded(tiny_llama(1, vocab_size=60), word_tokenizer(), "d")
    with pytest.raises(ModelLoadError, match="60 rows and the target's 64, but the tokenizer has 64 tokens"):
        check_same_vocabulary(target, small)


# -- check_architecture ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_supported_families_report_their_context(tiny_model, family: str) -> None:
    config = tiny_model(family, 0).config
    assert check_architecture(config) == config.max_position_embeddings


def test_sliding_window_limits_the_context(tiny_model) -> None:
    assert check_architecture(tiny_model("mistral", 0, sliding_window=16).config) == 16
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=24, max_window_layers=0, num_hidden_layers=2)
    assert check_architecture(qwen) == 24
    # a window Qwen2 does not use changes nothing
    assert check_architecture(Qwen2Config(use_sliding_window=False, sliding_window=24)) == 32768


def test_longrope_is_refused() -> None:
    """LongRoPE picks long or short frequencies by the longest position of the whole forward: a 3-token prompt's
    greedy tokens changed when a 30-token stream was verified beside it (25 of 30 seeds, a review)."""
    from conftest import build_tiny_model

    from spectot.engine.runner import ModelRunner

    longrope = {
        "rope_type": "longrope",
        "original_max_position_embeddings": 8,
        "long_factor": [1, 4, 16, 64],
        "short_factor": [1] * 4,
        "factor": 8.0,
    }
    model = build_tiny_model("llama", 0, max_position_embeddings=64, rope_scaling=longrope)
    with pytest.raises(ModelLoadError, match="LongRoPE picks its frequencies by the longest position"):
        check_architecture(model.config)
    with pytest.raises(ModelLoadError, match="LongRoPE picks"):
        ModelRunner(model)  # a model passed in directly: the runner checks it too
    assert check_architecture(build_tiny_model("llama", 0).config)  # default RoPE runs


def test_unsupported_family_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="model type 'gpt2' is not supported"):
        check_architecture(GPT2Config())


def test_linear_attention_is_refused() -> None:
    config = types.SimpleNamespace(model_type="qwen2", layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ModelLoadError, match="cannot be rolled back"):
        check_architecture(config)


# -- load_model ------------------------------------------------------------------------------------


def test_load_a_local_checkpoint(tiny_llama, tmp_path) -> None:
    model = tiny_llama(0)
    model.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)

    out = load_model(str(tmp_path), dtype="fp32")
    assert out.name == str(tmp_path)
    assert out.max_context == model.config.max_position_embeddings
    assert out.vocab_size == 64
    assert out.eos_token_ids == (2, 3)  # the config's </s> and the tokenizer's <eot>
    assert not out.model.training
    assert next(out.model.parameters()).dtype == torch.float32
    assert out.tokenizer.get_vocab() == word_tokenizer().get_vocab()
    ids = torch.tensor([[1, 7, 9, 30]])
    with torch.no_grad():
        assert torch.equal(out.model(ids.to(out.model.device)).logits.cpu(), model(ids).logits)

    half = load_model(str(tmp_path), dtype="bf16")
    assert next(half.model.parameters()).dtype == torch.bfloat16


def test_local_folder_without_config_is_refused(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_local_checkpoint_is_refused_before_loading_weights(tmp_path) -> None:
    GPT2Config(n_embd=32, n_layer=1, n_head=4).save_pretrained(tmp_path)  # config only, no weights
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(str(tmp_path))


def test_missing_hub_id_offline_asks_for_a_local_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import
    monkeypatch.chdir(tmp_path)  # so the id cannot name a local folder
    with pytest.raises(ModelLoadError, match="local folder path") as err:
        load_model("spectot-tests/no-such-model", dtype="fp32")
    assert "spectot-tests/no-such-model" in str(err.value)


def test_an_unreachable_hub_fails_in_seconds(tmp_path, monkeypatch) -> None:
    """No hub at the endpoint (a port nobody listens on): the error comes from one refused connect, not from
    the client's retries (~25 s here)."""
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="may be offline"):
        load_model("spectot-tests/no-such-model", dtype="fp32")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("name", ["./no-such-dir", "/tmp/no/such/dir", "smolm2-135m"])
def test_a_name_that_is_no_folder_alias_or_hub_id_is_refused_at_once(name, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="no such folder, and neither an alias"):
        load_model(name, dtype="fp32")


def test_a_truncated_checkpoint_is_named(tiny_checkpoint, tmp_path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=r"broken: cannot load the checkpoint \(SafetensorError"):
        load_model(str(broken), dtype="fp32")


def test_a_checkpoint_missing_weights_is_refused(tiny_checkpoint, tmp_path) -> None:
    """transformers fills absent weights with random values and warns where the CLI does not show it: a checkpoint
    without its LM head or a layer's MLP loaded, and generated noise with exit code 0."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "partial"
    shutil.copytree(tiny_checkpoint, broken)
    weights = load_file(broken / "model.safetensors")
    dropped = [k for k in weights if k.endswith("layers.1.mlp.down_proj.weight")]
    assert dropped
    save_file({k: v for k, v in weights.items() if k not in dropped}, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"partial: the checkpoint lacks 1 weight\(s\) of its architecture"):
        load_model(str(broken), dtype="fp32")
    assert load_model(str(tiny_checkpoint), dtype="fp32").model is not None  # a whole one (tied head) loads


def test_a_dtype_that_is_none_is_named_not_taken_for_a_broken_checkpoint(tiny_checkpoint) -> None:
    """load_model(path, dtype="auto") raised KeyError inside the load: 'cannot load the checkpoint ...; delete <the
    alias cache> and load the alias again'."""
    from spectot.config import ModelOptions

    for dtype in ("auto", "float32"):
        with pytest.raises(ValueError, match=f"dtype must be one of bf16, fp32, fp16, got '{dtype}'"):
            load_model(str(tiny_checkpoint), dtype=dtype)
    with pytest.raises(ValueError, match="--dtype must be one of"):
        ModelOptions(dtype="auto")


def test_weights_the_config_does_not_read_are_named(tiny_checkpoint, tmp_path, caplog) -> None:
    """A config.json declaring fewer layers than its weights hold loaded the declared ones, transformers' warning
    shown only under -v; the loader's own warning reaches the CLI's default level."""
    import json
    import shutil

    fewer = tmp_path / "fewer"
    shutil.copytree(tiny_checkpoint, fewer)
    config = json.loads((fewer / "config.json").read_text())
    assert config["num_hidden_layers"] >= 2
    config["num_hidden_layers"] = 1
    (fewer / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="spectot.models.loader"):
        assert load_model(str(fewer), dtype="fp32").model.config.num_hidden_layers == 1
    assert "fewer: the checkpoint holds" in caplog.text and "model.layers.1." in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="spectot.models.loader"):
        load_model(str(tiny_checkpoint), dtype="fp32")
    assert "does not read" not in caplog.text


def test_a_gguf_of_a_family_spectot_does_not_run_is_refused_before_it_is_dequantised(tmp_path, monkeypatch) -> None:
    """The whole file was dequantised to fp32 safetensors (minutes, gigabytes) and only then refused."""
    import transformers
    from transformers import PretrainedConfig

    from spectot.models.loader import ModelLoadError
    from spectot.models.registry import cached_models, convert_gguf

    gemma = PretrainedConfig()
    gemma.model_type = "gemma"
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *args, **kwargs: gemma)

    def dequantise(*args, **kwargs):
        raise AssertionError("the weights were dequantised")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", dequantise)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="model type 'gemma' is not supported"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "home" / "models" / "m")
    killed = tmp_path / "home" / "models" / "m.partial-x1"  # a conversion killed mid-write
    killed.mkdir(parents=True)
    (killed / "config.json").write_text("{}")
    assert cached_models(tmp_path / "home") == []


def test_an_alias_is_converted_again_when_its_packages_gguf_changes(tmp_path, monkeypatch, caplog) -> None:
    """The alias cache was keyed by the alias's name only: a reinstalled package with a new GGUF kept serving the
    old file's conversion."""
    import sys

    import spectot.models.registry as registry

    package = tmp_path / "site" / "fake_gguf_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "m.gguf").write_bytes(b"GGUF" + b"\1" * 100)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("fake_gguf_pkg", None)
    alias = registry.Alias("fake", "a test model", "fake_gguf_pkg", "m.gguf", "pip install fake")
    converted: list[bytes] = []

    def convert(gguf, out, cure=""):  # the real conversion dequantises a model: here it records the file's bytes
        tmp = out.with_name(out.name + ".partial-t")
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")
        (tmp / "weights").write_bytes(gguf.read_bytes())
        tmp.rename(out)
        converted.append(gguf.read_bytes())
        return out

    monkeypatch.setattr(registry, "convert_gguf", convert)
    home = tmp_path / "home"
    out = registry.materialize_alias(alias, home)
    assert registry.materialize_alias(alias, home) == out and len(converted) == 1  # once
    (package / "m.gguf").write_bytes(b"GGUF" + b"\2" * 100)  # the package reinstalled with another file
    with caplog.at_level("WARNING", logger="spectot.models.registry"):
        assert registry.materialize_alias(alias, home) == out
    assert "changed since it was converted" in caplog.text
    assert len(converted) == 2 and (out / "weights").read_bytes() == (package / "m.gguf").read_bytes()
    assert registry.cached_models(home) == [out]  # the old conversion is gone, not listed
    (package / "m.gguf").unlink()  # the package's file gone: the cache serves on its own
    assert registry.materialize_alias(alias, home) == out


def test_a_gguf_file_or_a_folder_of_one_is_converted_once(tmp_path, monkeypatch) -> None:
    """A GGUF passed by path was refused ('no config.json'); only the alias went through the conversion."""
    import spectot.models.loader as loader

    converted = []
    monkeypatch.setattr(loader, "convert_gguf", lambda gguf, out: converted.append((gguf, out)) or out)
    monkeypatch.setenv("SPECTOT_HOME", str(tmp_path / "home"))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.Q4.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    cached = loader.resolve_checkpoint(str(folder / "model.Q4.gguf"))
    assert cached.parent == tmp_path / "home/models" and cached.name.startswith("gguf-model.Q4-")
    assert loader.resolve_checkpoint(str(folder)) == cached
    assert [g for g, _ in converted] == [folder / "model.Q4.gguf"] * 2
    twin = tmp_path / "n"  # the same name and size elsewhere (two same-quant fine-tunes): its own folder
    twin.mkdir()
    (twin / "model.Q4.gguf").write_bytes(b"GGUF" + b"\1" * 12)
    assert loader.resolve_checkpoint(str(twin / "model.Q4.gguf")) != cached
    (folder / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="no config.json and 2 GGUF files \\(pass one\\)"):
        loader.resolve_checkpoint(str(folder))


def test_eos_ids_collects_every_source() -> None:
    model = types.SimpleNamespace(
        generation_config=types.SimpleNamespace(eos_token_id=[5, 7]),
        config=types.SimpleNamespace(eos_token_id=2),
    )
    tokenizer = types.SimpleNamespace(eos_token_id=7)
    assert eos_ids(model, tokenizer) == (2, 5, 7)
    bare = types.SimpleNamespace(generation_config=None, config=types.SimpleNamespace(eos_token_id=None))
    assert eos_ids(bare, types.SimpleNamespace(eos_token_id=None)) == ()


def test_device_auto_picks_the_gpu_torch_sees_else_the_cpu() -> None:
    from spectot.models.loader import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_a_cuda_device_without_a_gpu_is_refused_before_loading() -> None:
    from spectot.models.loader import ModelLoadError, resolve_device

    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "mps"])
def test_unknown_device_names_are_refused(device: str) -> None:
    from spectot.config import ModelOptions

    with pytest.raises(ValueError, match="--device must be"):
        ModelOptions(device=device)


def test_a_chat_templates_refusal_is_a_value_error_naming_the_template() -> None:
    """transformers raises jinja2's TemplateError (no ValueError): the CLI showed a traceback."""
    from conftest import build_tiny_tokenizer

    from spectot.models.loader import chat_ids

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
    )
    with pytest.raises(ValueError, match="the chat template refused the prompt: a system message first"):
        chat_ids(tokenizer, [{"role": "user", "content": "w5"}])
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert chat_ids(tokenizer, [{"role": "user", "content": "w5 w6"}]) == [9, 10]
