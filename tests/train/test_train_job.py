"""`spectot train-draft` end to end on a tiny checkpoint: features live in one folder per corpus file,
so a run that adds a file extracts only that file, and an edited file gets fresh features."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from spectot.config import ModelOptions, TrainDraftOptions
from spectot.train.job import run_train_draft


def corpus(path, seed: int, lines: int) -> str:
    rows = [" ".join(f"w{(seed + 3 * i + j) % 50 + 5}" for j in range(6 + i % 5)) for i in range(lines)]
    path.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    return str(path)


def small_job(tmp_path, corpus_file: str) -> TrainDraftOptions:
    """A one-layer draft trained one epoch on ``corpus_file`` into tmp_path/out, its features in tmp_path/f."""
    return TrainDraftOptions(
        corpus=(corpus_file,),
        out=str(tmp_path / "out"),
        features=str(tmp_path / "f"),
        head_vocab=16,
        layers=1,
        hidden_layer=-2,
        epochs=1,
    )


def test_features_are_extracted_once_per_corpus_file(tiny_checkpoint, tmp_path) -> None:
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    a, b = corpus(tmp_path / "a.jsonl", 0, 6), corpus(tmp_path / "b.jsonl", 7, 4)
    features = tmp_path / "features"

    def train(*files: str, out: str) -> tuple[dict, list[int]]:
        extracted = []

        def report(stage: str, done: int, total: int, **metrics) -> None:
            if stage == "features":
                extracted.append(done)

        options = TrainDraftOptions(
            corpus=files,
            out=str(tmp_path / out),
            features=str(features),
            head_vocab=16,
            epochs=1,
            layers=1,
            hidden_layer=-2,
        )
        return run_train_draft(model, options, report), extracted

    first, _ = train(a, out="one")
    folders = sorted(p.name for p in features.iterdir())
    assert len(folders) == 1 and folders[0].startswith("a-")
    mtimes = {p: p.stat().st_mtime_ns for p in features.rglob("shard_*.pt")}

    second, progress = train(a, b, out="two")
    assert sorted(p.name for p in features.iterdir())[0] == folders[0]
    assert {p: p.stat().st_mtime_ns for p in (features / folders[0]).glob("shard_*.pt")} == mtimes  # reused
    assert second["corpus"]["sequences"] == 10 and first["corpus"]["sequences"] == 6
    assert progress[-1] == second["corpus"]["tokens"]  # progress counts the whole corpus, reused files too

    corpus(tmp_path / "a.jsonl", 1, 6)  # an edited file is a new corpus
    train(a, out="three")
    assert len([p for p in features.iterdir() if p.name.startswith("a-")]) == 2


def test_init_fine_tunes_a_trained_draft_and_keeps_its_head(tiny_checkpoint, tmp_path) -> None:
    """--init starts from a trained draft: its head and layers are kept (whatever the new corpus's
    frequent tokens), it starts from the trained draft's weights, not a fresh one's; a draft of another
    kind, or a folder without one, is refused before any feature is extracted."""
    import pytest
    import torch
    from safetensors.torch import load_file

    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    a, b = corpus(tmp_path / "a.jsonl", 0, 8), corpus(tmp_path / "b.jsonl", 20, 8)
    common = {"features": str(tmp_path / "features"), "head_vocab": 16, "layers": 1, "lr": 1e-2, "hidden_layer": -2}

    def train(name: str, files: tuple[str, ...], **extra) -> dict:
        options = TrainDraftOptions(corpus=files, out=str(tmp_path / name), epochs=4, **{**common, **extra})
        return run_train_draft(model, options, lambda *args, **kwargs: None)

    train("base", (a,))
    train("fresh", (b,))
    tuned = train("tuned", (b,), init=str(tmp_path / "base"))
    weights = lambda name: load_file(str(tmp_path / name / "draft.safetensors"))  # noqa: E731
    base, fresh = weights("base"), weights("fresh")
    assert torch.equal(weights("tuned")["head_ids"], base["head_ids"])
    assert not torch.equal(fresh["head_ids"], base["head_ids"])
    assert tuned["draft"]["hidden_layer"] == -2 and tuned["options"]["init"] == str(tmp_path / "base")
    # it starts where the trained draft left off: at a learning rate too small to move a weight, the
    # result is the trained draft itself (a fresh start at that rate would keep the target's layers)
    train("kept", (b,), init=str(tmp_path / "base"), lr=1e-12)
    kept = weights("kept")
    assert kept.keys() == base.keys()
    assert all(torch.allclose(kept[k], base[k], rtol=0, atol=1e-9) for k in base)
    layer = next(k for k in base if "layers.0.mlp.down_proj" in k)
    assert not torch.allclose(fresh[layer], base[layer], rtol=0, atol=1e-6)

    # --next-token grows the trained draft an input for the token after each hidden entry, trained from 0
    grown = train("grown", (b,), init=str(tmp_path / "base"), next_token=True)
    assert grown["draft"]["next_token"] and weights("grown").keys() == base.keys() | {"next_proj.weight"}
    assert weights("grown")["next_proj.weight"].abs().sum() > 0  # it learnt something
    assert torch.equal(weights("grown")["head_ids"], base["head_ids"])
    # --current-token grows the next-token draft an input for each entry's own token; W_n is kept
    copy = train("copy", (b,), init=str(tmp_path / "grown"), next_token=True, current_token=True, lr=1e-12)
    assert copy["draft"]["current_token"] and copy["draft"]["next_token"]
    assert weights("copy").keys() == weights("grown").keys() | {"current_proj.weight"}
    assert weights("copy")["current_proj.weight"].abs().max() < 1e-9  # from 0, at a rate too small to move it
    assert torch.allclose(weights("copy")["next_proj.weight"], weights("grown")["next_proj.weight"], rtol=0, atol=1e-9)
    # --token-lr under --init: the draft's own token inputs count (README's recipe fine-tunes the shipped EDD so)
    train("token_lr", (b,), init=str(tmp_path / "grown"), token_lr=1e-3)
    with pytest.raises(ValueError, match="has none: pass --next-token"):
        train("token_lr_none", (b,), init=str(tmp_path / "base"), token_lr=1e-3)
    for flag in ("next_token", "current_token"):
        with pytest.raises(ValueError, match="--next-token and --current-token pair"):
            TrainDraftOptions(corpus=(b,), kind="vdm", **{flag: True})

    with pytest.raises(ValueError, match="holds a draft of kind edd: pass --kind edd"):
        train("wrong_kind", (b,), init=str(tmp_path / "base"), kind="vdm", hidden_layer=-4)
    with pytest.raises(ValueError, match="not a draft folder"):
        train("no_draft", (b,), init=str(tmp_path))
    assert not (tmp_path / "wrong_kind" / "train.json").exists()


def test_resume_refuses_a_checkpoint_of_another_draft_or_corpus_order(tiny_checkpoint, tmp_path) -> None:
    """The checkpoint's job covers the draft (its head), the corpus files in order and how their features were
    made: --head-vocab 12 or the files swapped would resume a 16-token head's weights, or another batch order."""
    import pytest

    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    a, b = corpus(tmp_path / "a.jsonl", 0, 6), corpus(tmp_path / "b.jsonl", 7, 4)
    common = {
        "features": str(tmp_path / "features"),
        "layers": 1,
        "epochs": 1,
        "out": str(tmp_path / "out"),
        "hidden_layer": -2,
    }

    def train(files: tuple[str, ...], **extra) -> dict:
        options = TrainDraftOptions(corpus=files, **{**common, "head_vocab": 16, **extra})
        return run_train_draft(model, options, lambda *args, **kwargs: None)

    train((a, b))
    assert train((a, b), resume=True)["train"]["steps"] >= 1  # the same job resumes
    with pytest.raises(ValueError, match=r"belongs to another training job \(identity differ\)"):
        train((a, b), resume=True, head_vocab=12)
    with pytest.raises(ValueError, match="belongs to another training job"):
        train((b, a), resume=True)


def test_prompts_are_encoded_as_the_pipeline_encodes_them(tiny_checkpoint, tmp_path) -> None:
    """--no-chat-template (or a tokenizer without one): question lines are the plain text with the tokenizer's
    special tokens, as Pipeline.encode feeds prompts; the tiny tokenizer has no template, so every line trains."""
    path = tmp_path / "q.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"w{i} w{i + 1}", "answer": f"w{i + 2} w9"}) + "\n" for i in range(5))
    )
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    options = TrainDraftOptions(
        corpus=(str(path),), out=str(tmp_path / "out"), head_vocab=16, epochs=1, layers=1, hidden_layer=-2
    )
    result = run_train_draft(model, options, lambda *args, **kwargs: None)
    assert result["corpus"]["sequences"] == 5 and result["corpus"]["skipped_lines"] == []


def test_a_hidden_layer_past_the_targets_layers_is_refused(tiny_checkpoint, tmp_path) -> None:
    """--hidden-layer 99 on a 2-layer target was read modulo 3: a draft trained on the embeddings."""
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "w1 w2", "answer": "w3 w4"}) + "\n")
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    options = TrainDraftOptions(corpus=(str(path),), out=str(tmp_path / "out"), hidden_layer=99, epochs=1)
    with pytest.raises(ValueError, match=r"--hidden-layer 99: the target has 2 layers"):
        run_train_draft(model, options, lambda *args, **kwargs: None)
    assert not (tmp_path / "out" / "draft.json").exists()
    # a draft deeper than its target kept random layers past the target's (a copied layer was promised)
    deep = TrainDraftOptions(corpus=(str(path),), out=str(tmp_path / "out"), kind="vdm", layers=3, epochs=1)
    with pytest.raises(ValueError, match=r"--layers 3: the target has 2"):
        run_train_draft(model, deep, lambda *args, **kwargs: None)
    assert not (tmp_path / "out" / "features").exists()


def test_init_reads_the_features_of_its_own_hidden_layer(tiny_checkpoint, tmp_path) -> None:
    """A draft trained on layer -2 and fine-tuned with --init (another --hidden-layer, or the default) trained on
    the flag's layer and still read -2 at inference; its features now come from the layer it reads."""
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    a = corpus(tmp_path / "a.jsonl", 0, 6)
    common = {"head_vocab": 16, "layers": 1, "epochs": 1}
    run_train_draft(model, TrainDraftOptions(corpus=(a,), out=str(tmp_path / "base"), hidden_layer=-2, **common))
    options = TrainDraftOptions(
        corpus=(a,), out=str(tmp_path / "tuned"), hidden_layer=-3, init=str(tmp_path / "base"), **common
    )
    tuned = run_train_draft(model, options)
    [meta] = (tmp_path / "tuned" / "features").glob("*/meta.json")
    assert json.loads(meta.read_text())["hidden_layer"] == -2 == tuned["draft"]["hidden_layer"]


def test_features_of_another_chat_template_are_not_reused(tiny_checkpoint, tmp_path) -> None:
    """Question lines tokenize with or without the chat template: features made one way were reused the other."""
    a = tmp_path / "q.jsonl"
    a.write_text("".join(json.dumps({"question": f"w{i} w{i + 1}", "answer": f"w{i + 2} w9"}) + "\n" for i in range(4)))
    options = small_job(tmp_path, str(a))
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    run_train_draft(model, options)
    with pytest.raises(ValueError, match="holds features of another setup"):
        run_train_draft(ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch"), options)


def test_features_of_another_target_at_the_same_path_are_not_reused(tiny_model, tmp_path) -> None:
    """The features' setup named the target by path: one retrained or downloaded anew there trained on the old one's
    hidden states and probabilities, in silence."""
    from conftest import build_tiny_tokenizer

    target = tmp_path / "target"
    tiny_model("llama", 0).save_pretrained(target)
    build_tiny_tokenizer().save_pretrained(target)
    options = small_job(tmp_path, corpus(tmp_path / "a.jsonl", 0, 4))
    model = ModelOptions(target=str(target), dtype="fp32", kernels="torch")
    run_train_draft(model, options)
    [meta_path] = (tmp_path / "f").glob("*/meta.json")
    meta = json.loads(meta_path.read_text())
    del meta["target_weights"]  # a folder from before the digest: reused (an interrupted extraction resumes)
    meta_path.write_text(json.dumps(meta))
    run_train_draft(model, replace(options, out=str(tmp_path / "out1")))
    run_train_draft(model, replace(options, out=str(tmp_path / "out3")))
    tiny_model("llama", 1).save_pretrained(target)  # other weights, same path
    with pytest.raises(ValueError, match="holds features of another setup"):
        run_train_draft(model, replace(options, out=str(tmp_path / "out2")))


def test_features_record_how_they_store_hidden_states(tiny_checkpoint, tmp_path) -> None:
    """Features from before the storage key held bf16 hidden states whatever the target's dtype: an fp32 target
    reused them as its own. Such a folder now counts as bf16 (refused for fp32, kept for bf16)."""
    a = corpus(tmp_path / "a.jsonl", 0, 4)
    options = small_job(tmp_path, a)
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    run_train_draft(model, options)
    [meta_path] = (tmp_path / "f").glob("*/meta.json")
    meta = json.loads(meta_path.read_text())
    assert meta["hidden_dtype"] == "float32" and meta["extracted_with"] == {"kernels": "torch", "device": "cpu"}
    del meta["hidden_dtype"], meta["extracted_with"]  # as a folder from before the key
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="holds features of another setup"):
        run_train_draft(model, options)
    bf16 = ModelOptions(target=str(tiny_checkpoint), dtype="bf16", kernels="torch", chat_template=False)
    meta["dtype"] = "bf16"
    meta_path.write_text(json.dumps(meta))
    run_train_draft(bf16, options)  # the old folder's bf16 hidden states are what a bf16 target stores


def test_a_max_len_past_the_targets_context_is_refused(tiny_checkpoint, tmp_path) -> None:
    """A text line cut to --max-len past the context failed partway through feature extraction."""
    a = corpus(tmp_path / "a.jsonl", 0, 2)
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    options = TrainDraftOptions(corpus=(a,), out=str(tmp_path / "out"), max_len=100_000, hidden_layer=-2, epochs=1)
    with pytest.raises(ValueError, match=r"--max-len 100000: the target's context holds \d+ tokens"):
        run_train_draft(model, options)
    assert not (tmp_path / "out" / "features").exists()


def test_the_weights_digest_reads_a_parameter_as_large_as_smollm2s_embedding() -> None:
    """A float32 linspace rounded the last index of 49,152 x 576 values (28,311,551) up past the end: every
    train-draft run on the default target failed with an IndexError."""
    import torch

    from spectot.train.job import weights_digest

    embedding = torch.nn.Embedding(49152, 576)
    torch.nn.init.zeros_(embedding.weight)
    digest = weights_digest(embedding)
    with torch.no_grad():
        embedding.weight[-1, -1] = 1.0  # the last value is among those read
    assert len(digest) == 16 and weights_digest(embedding) != digest


def test_a_line_the_chat_template_refuses_is_named_and_skipped(tiny_model, tmp_path) -> None:
    """A template's raise_exception on one question line ended the corpus read with jinja2's traceback; now the
    line is an issue named by its number, and the others train."""
    from conftest import build_tiny_tokenizer

    target = tmp_path / "target"
    tiny_model("llama", 0).save_pretrained(target)
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if 'w7' in messages[0]['content'] %}{{ raise_exception('no w7 here') }}{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    tokenizer.save_pretrained(target)
    path = tmp_path / "q.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"w{i} w{i + 1}", "answer": f"w{i + 2} w9"}) + "\n" for i in (3, 7, 11, 15))
    )
    model = ModelOptions(target=str(target), dtype="fp32", kernels="torch")
    result = run_train_draft(model, small_job(tmp_path, str(path)), lambda *args, **kwargs: None)
    [issue] = result["corpus"]["skipped_lines"]
    assert issue["line"] == 2 and "chat template refused the prompt: no w7 here" in issue["reason"]
    assert result["corpus"]["sequences"] == 3
