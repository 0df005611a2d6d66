"""Draft training: the corpus reader, feature extraction, the distillation loss, batching, one
training step, bit-for-bit resume from a checkpoint, and the learning-rate schedule.

Everything runs on a tiny random fp32 llama target with a one-layer EDD draft.
"""

from __future__ import annotations

from dataclasses import replace

import json
import logging
import math

import pytest
import torch

from spectot.data.jsonl import DataError
from spectot.engine.runner import ModelRunner
from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint, random_block_starts
from spectot.train.draft import (
    TrainSettings,
    collate,
    distill_loss,
    extract_features,
    learning_rate_factor,
    load_shards,
    make_batches,
    read_corpus,
    train,
)

HIDDEN_LAYER = -2
TOP_K = 8
HEAD_IDS = torch.arange(0, 64, 2)  # half the vocabulary: some of the target's top-k fall outside the head
# token sequences of different lengths (several batches with a small batch_tokens)
SEQUENCES = [[(7 * i + 3 * j) % 64 for j in range(n)] for i, n in enumerate([12, 9, 16, 7, 12, 20, 10, 14])]


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(0, num_hidden_layers=3)


def fresh_draft(target) -> DraftDecoder:
    config = DraftDecoderConfig("edd", 1, HIDDEN_LAYER, HEAD_IDS.numel(), fingerprint(target), target.config.to_dict())
    return DraftDecoder.initialise(config, target, HEAD_IDS)


@pytest.fixture(scope="module")
def records(target, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("features")
    paths = extract_features(ModelRunner(target), SEQUENCES, HIDDEN_LAYER, TOP_K, out, shard_tokens=40)
    return load_shards(paths)


# -- 1. corpus -------------------------------------------------------------------------------------


def encode_text(text: str) -> list[int]:
    return [ord(c) for c in text]


def encode_chat(text: str) -> list[int]:
    return [0] + encode_text(text) + [1]  # stands in for a chat template around the question


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_read_corpus_line_kinds_and_issues(tmp_path) -> None:
    lines = [
        json.dumps({"prompt_ids": [1, 2], "token_ids": [3, 4]}),  # 1: engine output
        "",  # 2: blank, skipped silently
        json.dumps({"question": "Hi?", "answer": "6*4=<<6*4=24>>24 so #### 24"}),  # 3
        json.dumps({"text": "abcdefghij"}),  # 4: cut to max_len
        "{not json",  # 5
        json.dumps({"foo": 1}),  # 6: no known field
        json.dumps({"token_ids": [1, "a"]}),  # 7: not an integer
        json.dumps({"token_ids": [1, -2]}),  # 8: negative
        json.dumps([1, 2, 3]),  # 9: not an object
        json.dumps({"token_ids": [5]}),  # 10: too short to train on, dropped with a warning, an issue
        json.dumps({"token_ids": [9, 8, 7]}),  # 11: engine output without prompt_ids
        json.dumps({"prompt_ids": list(range(10, 17)), "token_ids": [20, 21, 22]}),  # 12: whole (features: last 8)
        "[" * 100_000 + "]" * 100_000,  # 13: nested past the parser's recursion limit (it ended the read)
    ]
    sequences, issues = read_corpus([write_lines(tmp_path / "c.jsonl", lines)], encode_chat, encode_text, 8)
    assert sequences == [
        [1, 2, 3, 4],
        (encode_chat("Hi?") + encode_text("6*4=24 so #### 24"))[:8],
        encode_text("abcdefgh"),
        [9, 8, 7],
        [10, 11, 12, 13, 14, 15, 16, 20, 21, 22],
    ]
    assert [(i.line, i.reason.split(":")[0]) for i in issues] == [
        (5, "JSONDecodeError"),
        (6, "KeyError"),
        (7, "ValueError"),
        (8, "ValueError"),
        (9, "TypeError"),
        (10, "1 token(s)"),
        (13, "RecursionError"),
    ]
    assert all(i.path == str(tmp_path / "c.jsonl") for i in issues)


def test_read_corpus_removes_every_calculator_annotation(tmp_path) -> None:
    line = json.dumps({"question": "q", "answer": "a<<1+1=2>>2 b<<2*3=6>>6"})
    sequences, issues = read_corpus([write_lines(tmp_path / "g.jsonl", [line])], encode_chat, encode_text, 100)
    assert issues == []
    assert sequences == [encode_chat("q") + encode_text("a2 b6")]


def test_read_corpus_reads_several_files(tmp_path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [json.dumps({"text": "ab"})])
    b = write_lines(tmp_path / "b.jsonl", ["oops", json.dumps({"text": "cd"})])
    sequences, issues = read_corpus([a, b], encode_chat, encode_text, 10)
    assert sequences == [encode_text("ab"), encode_text("cd")]
    assert [(i.path, i.line) for i in issues] == [(b, 1)]


def test_read_corpus_of_only_bad_lines_raises(tmp_path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", ["nope", json.dumps({"token_ids": ["x"]})])
    with pytest.raises(DataError, match="2 malformed"):
        read_corpus([path], encode_chat, encode_text, 10)


def test_read_corpus_missing_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_corpus([str(tmp_path / "none.jsonl")], encode_chat, encode_text, 10)


def test_read_corpus_refuses_wrong_types_and_ids_outside_the_vocabulary(tmp_path) -> None:
    lines = [
        json.dumps({"token_ids": [1, 2, 3]}),  # 1: fine
        json.dumps({"token_ids": [True, False, 3]}),  # 2: bools are not token ids
        json.dumps({"token_ids": [1, 99999999]}),  # 3: tokenized for a larger vocabulary
        json.dumps({"token_ids": [1.0, 2.0]}),  # 4: floats
        json.dumps({"question": None, "answer": None}),  # 5: would train on "NoneNone"
        json.dumps({"question": "q", "answer": 7}),  # 6
        json.dumps({"text": ["a", "b"]}),  # 7
        json.dumps({"question": "q"}),  # 8: no answer: the question alone, as before
        json.dumps({"token_ids": [63, 0]}),  # 9: the last id of a 64-token vocabulary
    ]
    path = write_lines(tmp_path / "c.jsonl", lines)
    sequences, issues = read_corpus([path], encode_chat, encode_text, 100, vocab_size=64)
    assert sequences == [[1, 2, 3], encode_chat("q"), [63, 0]]
    assert [(i.line, i.reason.split(":")[0]) for i in issues] == [
        (2, "ValueError"),
        (3, "ValueError"),
        (4, "ValueError"),
        (5, "TypeError"),
        (6, "TypeError"),
        (7, "TypeError"),
    ]
    assert "99999999 is outside the target's vocabulary of 64" in issues[1].reason
    assert "'question' must be a string, got NoneType" in issues[3].reason
    assert read_corpus([path], encode_chat, encode_text, 100)[0][1] == [1, 99999999]  # no size: no range check


def test_read_corpus_warns_about_lines_too_short_to_train_on(tmp_path, caplog) -> None:
    lines = [json.dumps({"text": "ab"})] + [json.dumps({"text": t}) for t in ["", "x", "", "y", "z", "w", "v"]]
    path = write_lines(tmp_path / "short.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="spectot.train.draft"):
        sequences, issues = read_corpus([path], encode_chat, encode_text, 10)
    assert sequences == [encode_text("ab")] and [i.line for i in issues] == list(range(2, 9))
    assert issues[1].reason == "1 token(s): nothing to predict"  # in train.json's skipped lines too
    [record] = caplog.records
    assert record.getMessage() == f"{path}: 7 line(s) of fewer than 2 tokens dropped (lines 2, 3, 4, 5, 6, ...)"
    with pytest.raises(DataError, match=r"0 malformed, 7 too short"):
        read_corpus([write_lines(tmp_path / "all_short.jsonl", lines[1:])], encode_chat, encode_text, 10)


def test_read_corpus_reports_a_line_that_is_not_utf8_and_reads_on(tmp_path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"text": "ok"}\n'.encode("utf-8-sig") + b'{"text": "caf\xe9"}\n{"text": "on"}\n')
    sequences, issues = read_corpus([str(path)], encode_chat, encode_text, 10)
    assert sequences == [encode_text("ok"), encode_text("on")]  # a BOM before line 1 is no issue
    assert [(i.line, i.reason.split(":")[0]) for i in issues] == [(2, "DataError")]
    assert "not UTF-8 (byte 0xe9" in issues[0].reason


def test_read_corpus_directory_is_named_as_one(tmp_path) -> None:
    with pytest.raises(DataError, match="is a directory, expected a file"):
        read_corpus([str(tmp_path)], encode_chat, encode_text, 10)


# -- 2. features -----------------------------------------------------------------------------------


def test_features_are_the_targets_hidden_states_and_top_k(target, records) -> None:
    assert [r["tokens"].tolist() for r in records] == SEQUENCES
    with torch.no_grad():
        for r in records[:3]:
            out = target(r["tokens"][None].long().to(target.device), output_hidden_states=True)
            probs = out.logits[0].softmax(-1).cpu()
            top = probs.topk(TOP_K, dim=-1)
            assert r["top_ids"].dtype == torch.int32 and r["top_probs"].dtype == torch.float16
            assert r["hidden"].dtype == torch.float32  # the target's: an fp32 target's states were rounded to bf16
            torch.testing.assert_close(r["top_probs"].float(), top.values, atol=1e-3, rtol=1e-3)
            assert (r["top_ids"][:, 0] == probs.argmax(-1)).all()
            expected = out.hidden_states[HIDDEN_LAYER][0].cpu()
            torch.testing.assert_close(r["hidden"], expected, atol=1e-5, rtol=1e-5)


def test_feature_shards_already_written_are_skipped(target, tmp_path) -> None:
    first = extract_features(ModelRunner(target), SEQUENCES, HIDDEN_LAYER, TOP_K, tmp_path, shard_tokens=40)
    assert len(first) > 1 and all(p.exists() for p in first)
    assert len(first) == 3
    first[2].unlink()  # as if the run had stopped while writing shard 2

    class CountingRunner(ModelRunner):
        calls = 0

        def forward(self, *args, **kwargs):
            CountingRunner.calls += 1
            return super().forward(*args, **kwargs)

    reports: list[int] = []
    again = extract_features(
        CountingRunner(target),
        SEQUENCES,
        HIDDEN_LAYER,
        TOP_K,
        tmp_path,
        shard_tokens=40,
        report=lambda stage, done, total: reports.append(done),
    )
    assert again == first
    # the skipped shards 0 and 1 in one jump before shard 2 runs (skipped ones reported back to back were read as
    # the speed of extraction: a resumed run's ETA came out a fraction of the time left)
    assert reports == [sum(len(r["tokens"]) for path in again[:2] for r in torch.load(path)), sum(map(len, SEQUENCES))]
    rerun = torch.load(first[2])
    assert CountingRunner.calls == len(rerun)  # only the missing shard's sequences ran again
    assert [r["tokens"].tolist() for r in load_shards(again)] == SEQUENCES


def test_a_windowed_record_holds_the_features_of_its_whole_context(target, tmp_path) -> None:
    """A generation longer than --max-len trains on its last tokens with the hidden states and distributions the
    target computes over all of it (as at inference), not over the window alone (a sequence starting mid-text)."""
    whole = SEQUENCES[5]  # 20 tokens, window 8
    [windowed] = load_shards(
        extract_features(ModelRunner(target), [whole], HIDDEN_LAYER, TOP_K, tmp_path / "w", window=8)
    )
    [full] = load_shards(extract_features(ModelRunner(target), [whole], HIDDEN_LAYER, TOP_K, tmp_path / "f"))
    [cut] = load_shards(extract_features(ModelRunner(target), [whole[-8:]], HIDDEN_LAYER, TOP_K, tmp_path / "c"))
    assert windowed["tokens"].tolist() == whole[-8:]
    for key in ("hidden", "top_ids", "top_probs"):
        assert torch.equal(windowed[key], full[key][-8:])
    assert not torch.allclose(windowed["hidden"].float(), cut["hidden"].float(), atol=1e-2)


# -- 3. loss ---------------------------------------------------------------------------------------

# one batch of 2 streams x 3 positions over a head of 6 tokens, the target's top-3 per position
TOP_INDEX = torch.tensor(
    [
        [[2, 0, 5], [1, -1, 3], [4, 2, 0]],
        [[-1, 3, 1], [0, 1, 2], [5, 4, -1]],  # (1, 0): the target's argmax is outside the head
    ]
)
TOP_PROBS = torch.tensor(
    [
        [[0.5, 0.2, 0.1], [0.4, 0.3, 0.1], [0.6, 0.3, 0.05]],
        [[0.7, 0.1, 0.1], [0.3, 0.3, 0.2], [0.5, 0.25, 0.2]],
    ]
)
VALID = torch.ones(2, 3, dtype=torch.bool)


def renormalised_target() -> torch.Tensor:
    """(2, 3, 6): the target's probabilities on the head subset, renormalised there."""
    p = torch.zeros(2, 3, 6)
    inside = TOP_INDEX >= 0
    p.scatter_add_(-1, TOP_INDEX.clamp_min(0), torch.where(inside, TOP_PROBS, 0.0))
    return p / p.sum(-1, keepdim=True)


def test_distill_loss_is_zero_when_the_draft_is_the_target() -> None:
    logits = renormalised_target().clamp_min(1e-30).log()
    assert abs(float(distill_loss(logits, TOP_INDEX, TOP_PROBS, VALID))) < 1e-6


def test_distill_loss_is_the_kl_divergence() -> None:
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))
    p, log_q = renormalised_target(), logits.log_softmax(-1)
    kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)  # (2, 3)
    loss = distill_loss(logits, TOP_INDEX, TOP_PROBS, VALID)
    assert float(loss) > 0.01
    torch.testing.assert_close(loss, kl.mean())


def test_distill_loss_ignores_tokens_outside_the_head_and_invalid_positions() -> None:
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(1))
    loss = distill_loss(logits, TOP_INDEX, TOP_PROBS, VALID)
    outside = TOP_PROBS.clone()
    outside[TOP_INDEX < 0] = 0.9  # the probability of a token the head lacks does not count
    assert distill_loss(logits, TOP_INDEX, outside, VALID).equal(loss)
    valid = VALID.clone()
    valid[1, 2] = False
    changed = logits.clone()
    changed[1, 2] = 0.0  # an invalid position's logits do not count
    p, log_q = renormalised_target(), logits.log_softmax(-1)
    kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)
    torch.testing.assert_close(distill_loss(changed, TOP_INDEX, TOP_PROBS, valid), (kl.sum() - kl[1, 2]) / 5)


def test_distill_loss_ce_is_minus_log_q_of_the_target_argmax() -> None:
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(2))
    log_q = logits.log_softmax(-1)
    argmax = TOP_INDEX[..., 0]
    counted = argmax >= 0  # position (1, 0): the argmax is outside the head, so it is left out
    expected = -log_q.gather(-1, argmax.clamp_min(0)[..., None])[..., 0][counted].mean()
    torch.testing.assert_close(distill_loss(logits, TOP_INDEX, TOP_PROBS, VALID, "ce"), expected)


# -- 3. batching and training ----------------------------------------------------------------------


def test_make_batches_groups_similar_lengths_under_the_token_budget() -> None:
    assert make_batches([5, 3, 8, 3], 10) == [[1, 3], [0], [2]]
    lengths = [len(s) for s in SEQUENCES]
    batches = make_batches(lengths, 40)
    assert sorted(i for b in batches for i in b) == list(range(len(SEQUENCES)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 40


def test_collate_pads_and_maps_to_head_indices(records) -> None:
    head_index = torch.full((64,), -1, dtype=torch.int64)
    head_index[HEAD_IDS] = torch.arange(HEAD_IDS.numel())
    batch = collate(records, [3, 0], head_index)  # lengths 7 and 12
    assert batch["tokens"].shape == (2, 12)
    assert batch["valid"].sum(1).tolist() == [7, 12]
    assert batch["tokens"][0, :7].tolist() == SEQUENCES[3]
    top_ids = records[0]["top_ids"].long()
    expected = torch.where(top_ids % 2 == 0, top_ids // 2, -1)  # HEAD_IDS = the even ids
    assert batch["top_index"][1].equal(expected)
    assert (batch["top_index"][0, 7:] == -1).all() and (batch["top_probs"][0, 7:] == 0).all()


def batch_loss(draft: DraftDecoder, records: list[dict], settings: TrainSettings, step: int = 0) -> float:
    """The loss ``train`` computes at ``step`` when all records form one batch."""
    head_index = torch.full((64,), -1, dtype=torch.int64)
    head_index[draft.head_ids] = torch.arange(draft.head_ids.numel())
    batch = collate(records, list(range(len(records))), head_index)
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    starts = random_block_starts(batch["tokens"].shape[1], settings.block_min, settings.block_max, gen)
    with torch.no_grad():
        logits = draft(batch["tokens"], batch["hidden"], starts)
    return float(distill_loss(logits, batch["top_index"], batch["top_probs"], batch["valid"], settings.loss))


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_one_training_step_lowers_the_loss(target, records, tmp_path, loss: str) -> None:
    settings = TrainSettings(block_min=2, block_max=5, loss=loss, lr=2e-3, batch_tokens=10_000, epochs=1)
    draft = fresh_draft(target)
    frozen = {n: p.clone() for n, p in draft.named_parameters() if not p.requires_grad}
    trainable = {k: v.clone() for k, v in draft.trainable_state().items()}
    target_embed = target.get_input_embeddings().weight.clone()
    before = batch_loss(draft, records, settings)
    summary = train(draft, records, settings, tmp_path / "ckpt.pt", resume=False)
    assert summary["steps"] == 1
    assert summary["tokens"] == sum(len(s) for s in SEQUENCES)
    assert summary["final_loss"] == pytest.approx(before, rel=1e-5)  # the loss train saw is the one computed here
    after = batch_loss(draft, records, settings)
    assert after < before - 1e-3
    assert not draft.training
    assert all(p.equal(frozen[n]) for n, p in draft.named_parameters() if not p.requires_grad)
    assert target.get_input_embeddings().weight.equal(target_embed)
    assert all(not v.equal(trainable[k]) for k, v in draft.trainable_state().items())
    assert (tmp_path / "ckpt.pt").exists()


def test_bf16_autocast_training_keeps_fp32_weights_and_lowers_the_loss(target, records, tmp_path) -> None:
    settings = TrainSettings(block_min=2, block_max=5, lr=2e-3, batch_tokens=10_000, epochs=3, precision="bf16")
    draft = fresh_draft(target)
    before = batch_loss(draft, records, settings)
    train(draft, records, settings, tmp_path / "ckpt.pt", resume=False)
    assert all(v.dtype == torch.float32 for v in draft.trainable_state().values() if v.is_floating_point())
    assert batch_loss(draft, records, settings) < before - 1e-3  # measured in fp32


def test_token_inputs_take_their_own_learning_rate(target, records, tmp_path) -> None:
    """--token-lr: W_c and W_n (from 0) step at their own peak lr, every other weight at lr."""
    config = DraftDecoderConfig(
        "edd", 1, HIDDEN_LAYER, HEAD_IDS.numel(), fingerprint(target), target.config.to_dict(),
        next_token=True, current_token=True,
    )  # fmt: skip
    moved = {}
    for token_lr in (0.0, 1e-2):
        draft = DraftDecoder.initialise(config, target, HEAD_IDS)
        before = {k: v.clone() for k, v in draft.trainable_state().items()}
        settings = TrainSettings(block_min=2, block_max=5, lr=1e-4, token_lr=token_lr, batch_tokens=10_000, epochs=3)
        train(draft, records, settings, tmp_path / f"ckpt{token_lr}.pt", resume=False)
        moved[token_lr] = {k: float((v - before[k]).abs().max()) for k, v in draft.trainable_state().items()}
    for name in ("current_proj.weight", "next_proj.weight"):
        assert moved[1e-2][name] > 20 * moved[0.0][name]  # Adam moves a weight ~lr a step
    others = [k for k in moved[0.0] if not k.startswith(("current_proj", "next_proj"))]
    assert all(moved[1e-2][k] < 5 * moved[0.0][k] + 1e-6 for k in others)


class Interrupted(Exception):
    pass


def test_resume_from_a_checkpoint_continues_bit_for_bit(target, records, tmp_path) -> None:
    settings = TrainSettings(block_min=2, block_max=6, lr=1e-3, batch_tokens=40, epochs=2, checkpoint_minutes=0)
    total = 2 * len(make_batches([len(s) for s in SEQUENCES], settings.batch_tokens))
    assert total >= 6

    straight = fresh_draft(target)
    summary = train(straight, records, settings, tmp_path / "straight.pt", resume=False)
    assert summary["steps"] == total

    stop_after = 3  # the crash happens during step 4, after the checkpoint of step 3

    def crash(stage: str, done: int, total: int, **metrics) -> None:
        if done == stop_after + 1:
            raise Interrupted

    with pytest.raises(Interrupted):
        train(fresh_draft(target), records, settings, tmp_path / "resumed.pt", resume=False, report=crash)
    assert torch.load(tmp_path / "resumed.pt", weights_only=False)["state"]["step"] == stop_after

    resumed = fresh_draft(target)
    steps_seen: list[int] = []
    resumed_summary = train(
        resumed,
        records,
        settings,
        tmp_path / "resumed.pt",
        resume=True,
        report=lambda s, d, t, **m: steps_seen.append(d),
    )
    assert steps_seen == list(range(stop_after + 1, total + 1))  # it continued, it did not start over
    assert resumed_summary["steps"] == total and resumed_summary["tokens"] == summary["tokens"]
    a, b = straight.trainable_state(), resumed.trainable_state()
    assert all(a[k].equal(b[k]) for k in a)
    final_a = torch.load(tmp_path / "straight.pt", weights_only=False)["state"]["losses"]
    final_b = torch.load(tmp_path / "resumed.pt", weights_only=False)["state"]["losses"]
    assert len(final_a) == total and final_a == final_b
    assert resumed_summary["final_loss"] == summary["final_loss"]


def test_resume_refuses_a_checkpoint_of_another_job(target, records, tmp_path) -> None:
    settings = TrainSettings(block_min=2, block_max=6, lr=1e-3, batch_tokens=40, epochs=1, checkpoint_minutes=0)
    train(fresh_draft(target), records, settings, tmp_path / "ckpt.pt", resume=False)
    before = (tmp_path / "ckpt.pt").read_bytes()
    for other_records, other_settings in ((records[:-1], settings), (records, replace(settings, lr=2e-3))):
        with pytest.raises(ValueError, match="another training job"):
            train(fresh_draft(target), other_records, other_settings, tmp_path / "ckpt.pt", resume=True)
    assert (tmp_path / "ckpt.pt").read_bytes() == before  # nothing lost


def test_a_resume_without_a_checkpoint_says_it_starts_at_step_0(target, records, tmp_path, caplog) -> None:
    settings = TrainSettings(block_min=2, block_max=6, lr=1e-3, batch_tokens=40, epochs=1, checkpoint_minutes=0)
    with caplog.at_level("WARNING", logger="spectot.train.draft"):
        train(fresh_draft(target), records[:2], settings, tmp_path / "ckpt.pt", resume=True)
    assert "ckpt.pt holds no checkpoint; training starts at step 0" in caplog.text


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    total = 200  # warm-up: 2% of the steps = 4
    factors = [learning_rate_factor(step, total) for step in range(total + 1)]
    assert factors[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    decay = factors[4:]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert factors[4 + 98] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 98 / 196)))  # half way: 0.55
    assert factors[-1] == pytest.approx(0.1)
    assert learning_rate_factor(10 * total, total) == pytest.approx(0.1)  # past the end it stays at 0.1
    assert learning_rate_factor(0, 1) == 1.0  # one step: no warm-up below the peak


def test_ctrl_c_saves_the_last_whole_step_and_resume_goes_on_exactly(target, records, tmp_path) -> None:
    """SIGINT mid-run (checkpoints 60 minutes apart, so none would be written): the loop finishes its step,
    saves it and stops; --resume then ends where an uninterrupted run does."""
    import signal

    settings = TrainSettings(block_min=2, block_max=6, lr=1e-3, batch_tokens=40, epochs=2, checkpoint_minutes=60)
    straight = fresh_draft(target)
    summary = train(straight, records, settings, tmp_path / "straight.pt", resume=False)

    def interrupt(stage: str, done: int, total: int, **metrics) -> None:
        if done == 2:
            signal.raise_signal(signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # Python's default; ignored where a shell started the run with &
    with pytest.raises(KeyboardInterrupt, match="stopped at step 2; checkpoint saved"):
        train(fresh_draft(target), records, settings, tmp_path / "stopped.pt", resume=False, report=interrupt)
    assert torch.load(tmp_path / "stopped.pt", weights_only=False)["state"]["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # restored
    resumed = fresh_draft(target)
    assert train(resumed, records, settings, tmp_path / "stopped.pt", resume=True)["steps"] == summary["steps"]
    a, b = straight.trainable_state(), resumed.trainable_state()
    assert all(a[k].equal(b[k]) for k in a)


def test_a_stop_asked_during_the_last_step_still_ends_the_run(target, records, tmp_path) -> None:
    """SIGINT during the final step: that step's checkpoint is the finished run, so training returns (its draft is
    saved by the caller) instead of raising and leaving a complete run to --resume."""
    import signal

    settings = TrainSettings(block_min=2, block_max=6, lr=1e-3, batch_tokens=40, epochs=1, checkpoint_minutes=60)

    def interrupt(stage: str, done: int, total: int, **metrics) -> None:
        if done == total:
            signal.raise_signal(signal.SIGINT)

    summary = train(fresh_draft(target), records, settings, tmp_path / "c.pt", resume=False, report=interrupt)
    assert summary["steps"] == torch.load(tmp_path / "c.pt", weights_only=False)["state"]["step"] > 0
