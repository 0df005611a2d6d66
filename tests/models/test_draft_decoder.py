"""Draft decoders (EDD, VDM): the dual-block mask, block sampling, the training forward against the
inference path the proposer runs, draft files, and the head vocabulary.

The central invariant: teacher forcing with the dual-block mask computes, at every position of a
block, exactly the logits the proposer gets at inference (the target's hidden states of the tokens
before the block committed in the draft's cache, then the block's tokens as a chain).
"""

from __future__ import annotations

import copy
from dataclasses import replace
import dataclasses
import json

import pytest
import torch

from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.models.draft_decoder import (
    DraftDecoder,
    DraftDecoderConfig,
    dual_block_mask,
    embedding_sample,
    fingerprint,
    trained_for,
    head_vocabulary,
    random_block_starts,
    rank_head,
)

LAYERS = 3  # target layers: hidden_layer -2 reads the output of layer 2 of 3
HIDDEN_LAYER = -2
# a head subset that is neither a prefix nor contiguous, so a wrong row mapping shows
HEAD_IDS = torch.tensor(sorted(set(range(0, 64, 2)) | {1, 7, 33, 63}))


def SEEDED() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(0, num_hidden_layers=LAYERS)


def make_draft(target, kind: str, head_ids: torch.Tensor = HEAD_IDS, num_layers: int = 1) -> DraftDecoder:
    """kind edd, vdm, edd+next (hidden entries also read the next token) or edd+copy (the next token and their own)."""
    config = DraftDecoderConfig(
        kind.split("+")[0],
        num_layers,
        HIDDEN_LAYER if kind.startswith("edd") else None,
        head_ids.numel(),
        fingerprint(target),
        target.config.to_dict(),
        next_token=kind.endswith(("+next", "+copy")),
        current_token=kind.endswith("+copy"),
    )
    return DraftDecoder.initialise(config, target, head_ids)


# -- dual_block_mask / random_block_starts ---------------------------------------------------------


def test_dual_block_mask_docstring_table() -> None:
    mask = dual_block_mask(torch.tensor([0, 0, 2, 2]))
    #                   h0 h1 h2 h3  x0 x1 x2 x3
    tokens = [
        [0, 0, 0, 0, 1, 0, 0, 0],  # x0
        [0, 0, 0, 0, 1, 1, 0, 0],  # x1
        [1, 1, 0, 0, 0, 0, 1, 0],  # x2
        [1, 1, 0, 0, 0, 0, 1, 1],  # x3
    ]
    hidden = [  # hidden entries: causal over hidden entries, no token entries
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ]
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[bool(v) for v in row] for row in hidden + tokens]


def test_dual_block_mask_uneven_blocks() -> None:
    # blocks [0], [1, 2, 3], [4]
    mask = dual_block_mask(torch.tensor([0, 1, 1, 1, 4]))
    #                   h0 h1 h2 h3 h4  x0 x1 x2 x3 x4
    tokens = [
        [0, 0, 0, 0, 0, 1, 0, 0, 0, 0],  # x0: its own block only
        [1, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # x1: h0, then its block up to itself
        [1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 1],  # x4: h0..h3 and itself
    ]
    assert mask[5:].int().tolist() == tokens
    assert mask[:5, :5].equal(torch.ones(5, 5, dtype=torch.bool).tril())
    assert not mask[:5, 5:].any()


def block_lengths(starts: torch.Tensor) -> list[int]:
    firsts = [t for t in range(starts.numel()) if starts[t] == t]
    return [b - a for a, b in zip(firsts, firsts[1:] + [starts.numel()])]


@pytest.mark.parametrize("length, low, high", [(50, 3, 6), (7, 5, 10), (40, 1, 1)])
def test_random_block_starts_are_blocks_of_the_drawn_lengths(length: int, low: int, high: int) -> None:
    for seed in range(5):
        starts = random_block_starts(length, low, high, torch.Generator().manual_seed(seed))
        assert starts.shape == (length,) and starts.dtype == torch.int64
        assert starts[0] == 0
        positions = torch.arange(length)
        assert (starts <= positions).all()
        assert (starts[starts] == starts).all()  # every start opens its own block
        assert (starts[1:] >= starts[:-1]).all()
        lengths = block_lengths(starts)
        assert sum(lengths) == length
        assert all(low <= n <= high for n in lengths[:-1])
        assert 1 <= lengths[-1] <= high  # the last block may be cut short


def test_random_block_starts_are_deterministic_for_a_seed() -> None:
    def draw(seed: int) -> torch.Tensor:
        return random_block_starts(60, 2, 8, torch.Generator().manual_seed(seed))

    assert draw(3).equal(draw(3))
    assert any(not draw(3).equal(draw(s)) for s in range(4, 8))
    assert random_block_starts(7, 3, 3, torch.Generator()).tolist() == [0, 0, 0, 3, 3, 3, 6]


# -- the training forward is the inference path ----------------------------------------------------


@torch.no_grad()
def target_hidden(target, tokens: torch.Tensor) -> torch.Tensor:
    """(T, H) the target's hidden states at HIDDEN_LAYER, from transformers (not spectot's runner)."""
    out = target(tokens[None].to(target.device), output_hidden_states=True)
    return out.hidden_states[HIDDEN_LAYER][0]


@torch.no_grad()
def inference_block_logits(draft: DraftDecoder, tokens: torch.Tensor, hidden: torch.Tensor | None, s: int, e: int):
    """Logits at positions s..e-1 the way ``DraftDecoderProposer`` computes them: one forward over
    [committed entries x_<s, pending x_s] keeping only the committed ones, then the block x_s..x_{e-1}
    as a chain. EDD's committed entries are the hidden states through the projection."""
    runner = ModelRunner(draft.model)
    stream = runner.new_stream()
    embeds = None
    if hidden is not None:
        embed = draft.model.get_input_embeddings()
        pending = embed(tokens[s : s + 1].to(hidden.device))
        entries = draft.hidden_proj(hidden[:s])  # W_h h_i (+ W_c e(x_i)) (+ W_n e(x_{i+1}))
        if draft.current_proj is not None:
            entries = entries + draft.current_proj(embed(tokens[:s].to(hidden.device)))
        if draft.next_proj is not None:
            entries = entries + draft.next_proj(embed(tokens[1 : s + 1].to(hidden.device)))
        embeds = torch.cat([entries, pending])
    first = runner.forward([StreamTree(stream, TokenTree.chain(tokens[: s + 1]), embeds)], logit_rows=[[s]])
    runner.commit({stream: range(s)})
    assert runner.length(stream) == s
    block = runner.forward([StreamTree(stream, TokenTree.chain(tokens[s:e]))])
    runner.commit({})
    runner.release(stream)
    return first.logits[0][0], block.logits[0]  # (V',), (e - s, V')


@pytest.mark.parametrize("kind", ["edd", "vdm", "edd+next", "edd+copy"])
def test_training_forward_equals_inference(target, kind: str) -> None:
    draft = make_draft(target, kind, num_layers=1 if kind != "vdm" else 2)
    with torch.no_grad():  # non-identity, non-zero projections, so a missing or misplaced one shows
        if draft.hidden_proj is not None:
            draft.hidden_proj.weight.add_(
                0.05 * torch.randn(draft.hidden_proj.weight.shape, generator=SEEDED()).to(target.device)
            )
        for proj, seed in ((draft.next_proj, 0), (draft.current_proj, 1)):
            if proj is not None:
                proj.weight.add_(0.5 * torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(seed)))
    tokens = torch.tensor([5, 17, 42, 8, 3, 60, 21, 9, 14, 33, 2, 50])
    starts = torch.tensor([0, 0, 0, 3, 3, 3, 3, 7, 7, 7, 7, 7])
    hidden = target_hidden(target, tokens) if kind != "vdm" else None
    with torch.no_grad():
        train_logits = draft(tokens[None].to(target.device), None if hidden is None else hidden[None], starts)[0].cpu()
    assert train_logits.shape == (tokens.numel(), HEAD_IDS.numel())
    for s, e in [(0, 3), (3, 7), (7, 12)]:
        pending, block = inference_block_logits(draft, tokens, hidden, s, e)
        torch.testing.assert_close(pending, train_logits[s], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(block, train_logits[s:e], atol=1e-4, rtol=1e-4)
    if kind != "vdm":  # the hidden states matter: with other block starts the logits change
        with torch.no_grad():
            other = draft(tokens[None].to(target.device), hidden[None], torch.zeros_like(starts))[0].cpu()
        assert not torch.allclose(other[3:], train_logits[3:], atol=1e-3)
        torch.testing.assert_close(other[:3], train_logits[:3])  # block [0, 3) is the same in both


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("qwen2", {}), ("qwen2", {"use_sliding_window": True, "sliding_window": 4}), ("qwen3", {}), ("mistral", {})],
)
def test_drafts_of_other_families_build_and_match_inference(tiny_model, family: str, overrides: dict) -> None:
    """Qwen2 / Qwen3 configs carry one layer type per target layer: a draft of fewer layers was refused by
    transformers, after train-draft's whole feature extraction. A sliding window is the target's, not the draft's."""
    other = tiny_model(family, 0, num_hidden_layers=LAYERS, **overrides)
    draft = make_draft(other, "edd")
    tokens = torch.tensor([5, 17, 42, 8, 3, 60, 21, 9])
    starts = torch.tensor([0, 0, 0, 3, 3, 3, 3, 3])
    hidden = target_hidden(other, tokens)
    with torch.no_grad():
        train_logits = draft(tokens[None], hidden[None], starts)[0]
    for s, e in [(0, 3), (3, 8)]:
        pending, block = inference_block_logits(draft, tokens, hidden, s, e)
        torch.testing.assert_close(block, train_logits[s:e], atol=1e-4, rtol=1e-4)


def test_draft_head_is_the_target_rows_of_head_ids(target) -> None:
    draft = make_draft(target, "edd")
    assert draft.model.lm_head.weight.equal(target.get_output_embeddings().weight[HEAD_IDS])
    assert draft.model.get_input_embeddings().weight.equal(target.get_input_embeddings().weight)
    assert not any(p.requires_grad for p in (draft.model.lm_head.weight, draft.model.get_input_embeddings().weight))
    assert set(draft.trainable_state()) == {n for n, p in draft.named_parameters() if p.requires_grad}


def json_round_trip(value):
    return json.loads(json.dumps(value))


# -- files -----------------------------------------------------------------------------------------


def test_save_load_round_trip(target, tmp_path) -> None:
    draft = make_draft(target, "edd")
    gen = SEEDED()
    with torch.no_grad():  # values bf16 cannot hold exactly, so the round trip really rounds
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(1e-3 * torch.randn(p.shape, generator=gen).to(p.device))
    draft.save(tmp_path / "edd", draft.head_ids)
    loaded = DraftDecoder.load(tmp_path / "edd", target)
    # the config comes back through JSON (which turns integer dict keys into strings)
    assert loaded.config == dataclasses.replace(draft.config, target_config=json_round_trip(draft.config.target_config))
    assert loaded.head_ids.equal(HEAD_IDS)
    assert not loaded.training
    saved, restored = draft.trainable_state(), loaded.trainable_state()
    assert set(saved) == set(restored) and "hidden_proj.weight" in saved
    for name, value in saved.items():
        assert restored[name].dtype == torch.float32
        assert restored[name].equal(value.to(torch.bfloat16).float()), name
    assert any(not restored[n].equal(saved[n]) for n in saved)  # the file holds bf16, not fp32
    assert loaded.model.lm_head.weight.equal(target.get_output_embeddings().weight[HEAD_IDS])


def test_weights_beside_another_saves_config_are_refused(target, tmp_path) -> None:
    """A kill between save's two renames left new weights beside the old draft.json, which loaded in silence
    when the shapes agreed (another hidden layer)."""
    make_draft(target, "edd").save(tmp_path / "edd", HEAD_IDS)
    old_config = (tmp_path / "edd" / "draft.json").read_text()
    other = make_draft(target, "edd")
    other.config = replace(other.config, hidden_layer=-3)
    other.save(tmp_path / "edd", HEAD_IDS)
    DraftDecoder.load(tmp_path / "edd", target)  # a whole save loads
    (tmp_path / "edd" / "draft.json").write_text(old_config)  # as a kill after the weights' rename leaves it
    with pytest.raises(ValueError, match="come from two saves"):
        DraftDecoder.load(tmp_path / "edd", target)


@pytest.mark.parametrize("name", ["next_token", "current_token"])
def test_an_edd_gains_a_token_input_at_zero_weight(target, tmp_path, name: str) -> None:
    draft = make_draft(target, "edd")
    with torch.no_grad():
        draft.hidden_proj.weight.add_(0.05 * torch.randn(draft.hidden_proj.weight.shape, generator=SEEDED()))
    draft.save(tmp_path / "edd", draft.head_ids)
    plain = DraftDecoder.load(tmp_path / "edd", target)
    grown = DraftDecoder.load(tmp_path / "edd", target, **{f"add_{name}": True})
    proj = lambda d: getattr(d, name.replace("_token", "_proj"))  # noqa: E731  W_n or W_c
    assert getattr(grown.config, name) and not getattr(plain.config, name) and proj(plain) is None
    assert proj(grown).weight.abs().sum() == 0  # zero: the same function as before
    tokens = torch.tensor([[5, 17, 42, 8, 3, 60, 21]])
    hidden = target_hidden(target, tokens[0])[None]
    starts = torch.tensor([0, 0, 0, 3, 3, 3, 3])
    with torch.no_grad():
        torch.testing.assert_close(grown(tokens, hidden, starts), plain(tokens, hidden, starts))
        proj(grown).weight.fill_(0.01)
        assert not torch.allclose(grown(tokens, hidden, starts)[0, 3:], plain(tokens, hidden, starts)[0, 3:])
    grown.save(tmp_path / "grown", grown.head_ids)  # a draft with the input keeps it
    again = DraftDecoder.load(tmp_path / "grown", target)
    assert getattr(again.config, name) and proj(again).weight.equal(proj(grown).weight.to(torch.bfloat16).float())
    vdm = make_draft(target, "vdm", num_layers=2)
    vdm.save(tmp_path / "vdm", vdm.head_ids)
    with pytest.raises(ValueError, match="reads none"):
        DraftDecoder.load(tmp_path / "vdm", target, **{f"add_{name}": True})


def test_load_refuses_a_draft_of_another_target(target, tiny_llama, tmp_path) -> None:
    make_draft(target, "vdm").save(tmp_path / "vdm", HEAD_IDS)
    other = tiny_llama(1, num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="another target"):
        DraftDecoder.load(tmp_path / "vdm", other)


def test_load_of_a_missing_folder(target, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="draft.json"):
        DraftDecoder.load(tmp_path / "missing", target)


def test_fingerprint_ignores_dtype_and_tells_targets_apart(target, tiny_llama) -> None:
    assert fingerprint(copy.deepcopy(target).to(torch.bfloat16)) == fingerprint(target)
    assert fingerprint(tiny_llama(1, num_hidden_layers=LAYERS)) != fingerprint(target)


def test_a_draft_with_the_targets_sample_loads_on_it_in_any_dtype(target, tiny_llama, tmp_path) -> None:
    """fp16 rounds some embedding values differently on their way to the bf16 fingerprint (the shipped EDD was
    refused under --dtype fp16); the stored sample is compared within rounding instead."""
    draft = make_draft(target, "vdm")
    sampled = replace(draft.config, target_sample=embedding_sample(target))
    draft.config = sampled
    draft.save(tmp_path / "vdm", HEAD_IDS)
    assert DraftDecoder.read_config(tmp_path / "vdm").target_sample == sampled.target_sample
    for dtype in (torch.float16, torch.bfloat16):
        assert trained_for(sampled, copy.deepcopy(target).to(dtype))
    with pytest.raises(ValueError, match="another target"):
        DraftDecoder.load(tmp_path / "vdm", tiny_llama(1, num_hidden_layers=LAYERS))


def test_truncated_draft_weights_are_named(target, tmp_path) -> None:
    make_draft(target, "vdm").save(tmp_path / "vdm", HEAD_IDS)
    weights = tmp_path / "vdm" / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(ValueError, match=r"draft.safetensors: cannot read the draft's weights"):
        DraftDecoder.load(tmp_path / "vdm", target)


def test_a_broken_draft_config_is_named(tmp_path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "draft.json").write_text('{"kind": "edd", "surprise": 1}')
    with pytest.raises(ValueError, match=r"bad/draft.json: not a draft config"):
        DraftDecoder.read_config(tmp_path / "bad")


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        DraftDecoderConfig("vdm", 0, None, 8, "0" * 16, {})


# -- head vocabulary -------------------------------------------------------------------------------

COUNTS = torch.tensor([5, 0, 9, 1, 7, 3])  # frequency order: 2, 4, 0, 5, 3, 1


@pytest.mark.parametrize(
    "size, always, expected",
    [
        (3, (), [2, 4, 0]),  # most frequent first
        (3, (1,), [1, 2, 4]),  # the rarest, forced in first, displaces the least frequent of the top 3
        (3, (2,), [2, 4, 0]),  # already among the top 3: only its place changes
        (4, (3, 1), [1, 3, 2, 4]),  # forced ids first, ascending
        (10, (1,), [1, 2, 4, 0, 5, 3]),  # capped at the vocabulary
    ],
)
def test_head_vocabulary_table(size: int, always: tuple[int, ...], expected: list[int]) -> None:
    head = head_vocabulary(COUNTS, size, always)
    assert head.dtype == torch.int64
    assert head.tolist() == expected


@pytest.mark.parametrize("always", [(0, 1), (1, 1), (5, 1, 0)])
def test_head_vocabulary_keeps_every_always_id(always: tuple[int, ...]) -> None:
    """Contract: distinct, ``size`` ids, the ``always`` ids first, then the most frequent others in order."""
    head = head_vocabulary(COUNTS, 3, always).tolist()
    forced = sorted(set(always))
    assert len(set(head)) == len(head) == 3
    assert head[: len(forced)] == forced
    frequent = [t for t in COUNTS.argsort(descending=True, stable=True).tolist() if t not in always]
    assert head[len(forced) :] == frequent[: 3 - len(forced)]


def test_head_vocabulary_of_random_counts() -> None:
    counts = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(0))
    head = head_vocabulary(counts, 50, always=(199,))
    assert head.numel() == 50 and head.unique().numel() == 50
    assert head[0] == 199 and (counts[head[1:-1]] >= counts[head[2:]]).all()  # ranked: any prefix is a head
    others = [t for t in head.tolist() if t != 199]
    threshold = counts[others].min()
    outside = torch.ones(200, dtype=torch.bool)
    outside[head] = False
    assert (counts[outside] <= threshold).all()  # nothing left out is more frequent than what was kept


def test_rank_head_keeps_the_set_and_orders_it_like_head_vocabulary() -> None:
    assert rank_head(torch.tensor([3, 5, 9]), torch.tensor([0, 0, 0, 1, 0, 7, 0, 0, 0, 7]), (9,)).tolist() == [9, 5, 3]
    counts = torch.randint(0, 50, (300,), generator=SEEDED())
    head = torch.randperm(300, generator=SEEDED())[:40].sort().values
    outside = next(t for t in range(300) if t not in head.tolist())
    ranked = rank_head(head, counts, always=(int(head[7]), outside))
    assert sorted(ranked.tolist()) == head.tolist()  # the same ids: the same draft function
    assert ranked[0] == head[7]  # an always id in the head comes first; one outside it is not added
    assert (counts[ranked[1:-1]] >= counts[ranked[2:]]).all()


def test_a_ranked_head_is_cut_to_its_most_frequent_tokens(target, tmp_path) -> None:
    ranked = HEAD_IDS[torch.randperm(HEAD_IDS.numel(), generator=SEEDED())]  # any order, as long as it is stored
    draft = make_draft(target, "edd", head_ids=ranked)
    draft.save(tmp_path / "unranked", ranked)
    with pytest.raises(ValueError, match="not ranked"):
        DraftDecoder.load(tmp_path / "unranked", target, head_size=8)
    draft.config = dataclasses.replace(draft.config, head_ranked=True)
    draft.save(tmp_path / "ranked", ranked)
    whole = DraftDecoder.load(tmp_path / "ranked", target)
    cut = DraftDecoder.load(tmp_path / "ranked", target, head_size=8)
    assert whole.head_ids.equal(ranked) and cut.head_ids.equal(ranked[:8]) and cut.config.head_vocab == 8
    assert cut.model.lm_head.weight.equal(target.get_output_embeddings().weight[ranked[:8]])
    assert DraftDecoder.load(tmp_path / "ranked", target, head_size=1000).head_ids.equal(ranked)  # no cut past it
    tokens = torch.tensor([[5, 17, 42, 8, 3, 60, 21]])
    hidden = target_hidden(target, tokens[0])[None]
    starts = torch.tensor([0, 0, 0, 3, 3, 3, 3])
    with torch.no_grad():  # the same layer: the cut head's logits are the whole head's first 8
        torch.testing.assert_close(cut(tokens, hidden, starts), whole(tokens, hidden, starts)[..., :8])
    with pytest.raises(ValueError, match="head_size"):
        DraftDecoder.load(tmp_path / "ranked", target, head_size=-1)


@pytest.mark.parametrize("hidden_layer", [-1, LAYERS, -2])
def test_a_draft_reading_one_of_the_last_layers_copies_the_targets_last_layers(target, hidden_layer: int) -> None:
    """Reading after the last layer (-1 or L) no layer follows, and -2 has one where the draft has two: the zip over
    the missing source left those layers at random initialisation; they copy the target's last layers now."""
    config = DraftDecoderConfig("edd", 2, hidden_layer, HEAD_IDS.numel(), fingerprint(target), target.config.to_dict())
    draft = DraftDecoder.initialise(config, target, HEAD_IDS)
    for mine, theirs in zip(draft.model.model.layers, target.model.layers[-2:]):
        a, b = mine.state_dict(), theirs.state_dict()
        assert all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in b)
