"""Decoder: speculative decoding is lossless, batching changes nothing, and generation stops where
it should.

Greedy invariants run on tiny random fp32 models: ``sd`` == ``ar`` token for token with a draft that
always agrees (the target itself), one that rarely does (another random model) and prompt lookup.
The sampling invariant compares the empirical joint distribution of sd's first tokens with the
exact one computed from the target's HF logits.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from spectot.engine.runner import ModelRunner
from spectot.spec.decoding import DecodeConfig, Decoder, StreamResult
from spectot.spec.draft_length import DraftLength
from spectot.spec.proposers.draft_model import DraftModelProposer
from spectot.spec.proposers.ngram import NgramProposer
from spectot.spec.sampling import SamplingParams

TARGET_SEED, DRAFT_SEED = 0, 1
REF_TOKENS = 40  # length of the greedy AR reference every greedy test compares against
# (prompt, max_new_tokens): a one-token prompt, a short one, and a longer one
CASES = [
    ([5], 20),
    ([3, 17, 42, 8], 33),
    ([21, 9, 60, 2, 2, 14, 33, 7, 50, 11, 38], 40),
]
SAMPLE = SamplingParams(do_sample=True, temperature=1.0)


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(TARGET_SEED)


@pytest.fixture(scope="module")
def other_draft(tiny_llama):
    return tiny_llama(DRAFT_SEED)


def make_proposer(kind: str, target, other_draft):
    if kind == "same":  # the target as its own draft: every greedy draft is accepted
        return DraftModelProposer(ModelRunner(target))
    if kind == "other":  # an unrelated random model: drafts are rarely accepted
        return DraftModelProposer(ModelRunner(other_draft))
    return NgramProposer()


def run(model, prompts, proposer=None, eos=(), detokenize=None, **config) -> list[StreamResult]:
    decoder = Decoder(ModelRunner(model), eos, proposer, detokenize=detokenize)
    return decoder.generate(prompts, DecodeConfig(**config))


@pytest.fixture(scope="module")
def ar_reference(target):
    """prompt -> the target's greedy AR continuation of REF_TOKENS tokens (no EOS), checked once
    against a plain HF greedy loop."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            tokens = run(target, [prompt], max_new_tokens=REF_TOKENS)[0].token_ids
            assert tokens == hf_greedy(target, prompt, REF_TOKENS)
            cache[key] = tokens
        return cache[key]

    return reference


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def assert_caches_empty(decoder: Decoder) -> None:
    """Nothing leaked: every slot still held belongs to the prefix cache."""
    decoder.prefix_cache.clear()
    assert decoder.runner.cache.used == 0
    assert decoder.runner.cache.streams == {}
    if isinstance(decoder.proposer, DraftModelProposer):
        assert decoder.proposer.runner.cache.used == 0
        assert decoder.proposer.runner.cache.streams == {}


# -- the AR baseline -------------------------------------------------------------------------


@pytest.mark.parametrize("family, seed", [("llama", 0), ("qwen2", 1), ("mistral", 2), ("qwen3", 3)])
def test_greedy_ar_and_sd_match_hf_greedy(tiny_model, family: str, seed: int) -> None:
    model = tiny_model(family, seed)
    prompt = CASES[1][0]
    expected = hf_greedy(model, prompt, 24)
    ar = run(model, [prompt], max_new_tokens=24)[0]
    assert ar.token_ids == expected
    assert ar.finish_reason == "length"
    assert ar.stats.new_tokens == 24
    assert ar.stats.mean_acceptance_length == 1.0
    assert ar.stats.target_forwards == 24  # one prefill + one forward per further token
    sd = run(model, [prompt], NgramProposer(), max_new_tokens=24, method="sd", num_draft_tokens=3)[0]
    assert sd.token_ids == expected


# -- greedy sd == greedy ar ------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_sd_with_the_target_as_draft(target, ar_reference, case: int, k: int) -> None:
    prompt, max_new = CASES[case]
    decoder = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(target)))
    [out] = decoder.generate([prompt], DecodeConfig(max_new_tokens=max_new, method="sd", num_draft_tokens=k))
    assert out.token_ids == ar_reference(prompt)[:max_new]
    assert out.finish_reason == "length"
    stats = out.stats
    assert stats.acceptance_rate == 1.0
    assert stats.mean_acceptance_length > 1
    # every step emits min(k + 1, tokens left): the prefill gives the first token
    assert stats.verify_steps == math.ceil((max_new - 1) / (k + 1))
    assert stats.target_forwards == 1 + stats.verify_steps
    assert stats.new_tokens == max_new
    assert_caches_empty(decoder)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_sd_with_an_unrelated_draft(target, other_draft, ar_reference, case: int, k: int) -> None:
    prompt, max_new = CASES[case]
    decoder = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(other_draft)))
    [out] = decoder.generate([prompt], DecodeConfig(max_new_tokens=max_new, method="sd", num_draft_tokens=k))
    assert out.token_ids == ar_reference(prompt)[:max_new]
    assert out.stats.proposed > 0
    assert out.stats.accepted < out.stats.proposed  # rejections happened and were rolled back
    assert out.stats.draft_forwards > 0
    assert_caches_empty(decoder)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_sd_with_ngram_drafts(target, ar_reference, case: int, k: int) -> None:
    prompt, max_new = CASES[case]
    decoder = Decoder(ModelRunner(target), (), NgramProposer())
    [out] = decoder.generate([prompt], DecodeConfig(max_new_tokens=max_new, method="sd", num_draft_tokens=k))
    assert out.token_ids == ar_reference(prompt)[:max_new]
    assert out.stats.proposed > 0
    assert out.stats.draft_forwards == 0
    assert_caches_empty(decoder)


# -- batches -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method, draft", [("ar", "none"), ("sd", "other"), ("sd", "same"), ("sd", "ngram")])
def test_batch_equals_each_stream_alone(target, other_draft, ar_reference, method: str, draft: str) -> None:
    prompts = [case[0] for case in CASES]
    # an EOS that ends stream 0 early while stream 1 runs to max_new_tokens
    eos = next(t for t in ar_reference(prompts[0]) if t not in ar_reference(prompts[1]))
    config = dict(max_new_tokens=30, method=method, num_draft_tokens=3)

    def proposer():
        return None if draft == "none" else make_proposer(draft, target, other_draft)

    decoder = Decoder(ModelRunner(target), (eos,), proposer())
    together = decoder.generate(prompts, DecodeConfig(**config))
    alone = [run(target, [p], proposer(), eos=(eos,), **config)[0] for p in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    assert [r.prompt_ids for r in together] == prompts
    assert together[0].finish_reason == "eos"
    assert together[1].finish_reason == "length"
    assert_caches_empty(decoder)
    # the decoder (and its draft's per-stream state) is reusable
    again = decoder.generate(prompts, DecodeConfig(**config))
    assert [r.token_ids for r in again] == [r.token_ids for r in together]


@pytest.mark.parametrize("draft", ["other", "same", "ngram"])
def test_the_batched_attention_path_keeps_ar_greedy(target, other_draft, ar_reference, draft: str) -> None:
    """The batched float64 attention a GPU runs (forced here on the CPU): the three prompts decoded together
    by sd with target and draft on that path give the greedy AR reference, token for token."""
    prompts = [case[0] for case in CASES]
    runner = ModelRunner(target, native_attention=False)
    proposer = NgramProposer() if draft == "ngram" else None
    if proposer is None:
        proposer = DraftModelProposer(ModelRunner(target if draft == "same" else other_draft, native_attention=False))
    decoder = Decoder(runner, (), proposer)
    outs = decoder.generate(prompts, DecodeConfig(max_new_tokens=REF_TOKENS, method="sd", num_draft_tokens=3))
    assert [o.token_ids for o in outs] == [ar_reference(p) for p in prompts]
    assert sum(o.stats.accepted for o in outs) > 0
    ar = Decoder(ModelRunner(target, native_attention=False)).generate(
        prompts, DecodeConfig(max_new_tokens=REF_TOKENS, method="ar")
    )
    assert [o.token_ids for o in ar] == [ar_reference(p) for p in prompts]
    assert_caches_empty(decoder)


def test_cache_growth_mid_generation_changes_nothing(target, other_draft, ar_reference) -> None:
    # target and draft caches start with 4 slots and must grow several times during the run
    decoder = Decoder(ModelRunner(target, capacity=4), (), DraftModelProposer(ModelRunner(other_draft, capacity=4)))
    prompts = [case[0] for case in CASES]
    outs = decoder.generate(prompts, DecodeConfig(max_new_tokens=30, method="sd", num_draft_tokens=3))
    assert [r.token_ids for r in outs] == [ar_reference(p)[:30] for p in prompts]
    assert decoder.runner.cache.capacity >= sum(len(p) for p in prompts) + 3 * 29
    assert_caches_empty(decoder)


# -- sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_seeded_sampling_is_reproducible(target, other_draft, method: str) -> None:
    prompts = [case[0] for case in CASES]

    def sample_run(seed: int, decoder: Decoder | None = None) -> list[list[int]]:
        decoder = decoder or Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(other_draft)))
        config = DecodeConfig(max_new_tokens=20, sampling=SAMPLE, method=method, num_draft_tokens=3, seed=seed)
        return [r.token_ids for r in decoder.generate(prompts, config)]

    shared = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(other_draft)))
    first = sample_run(0)
    assert sample_run(0) == first
    assert sample_run(0, shared) == first
    assert sample_run(0, shared) == first  # state left by earlier calls changes nothing
    outputs = {tuple(map(tuple, sample_run(seed))) for seed in range(1, 4)}
    assert len(outputs | {tuple(map(tuple, first))}) > 1


@pytest.mark.parametrize("width", [1, 3])
def test_sampled_sd_with_a_deterministic_draft_emits_ars_samples(target, width: int) -> None:
    """Coupled verification: with the same seed, sampled ``sd`` under n-gram chains or trees emits the
    very tokens sampled ``ar`` draws (fp32), not just tokens from the same distribution."""
    prompts = [case[0] for case in CASES] + [[4, 9, 4, 9, 4, 9, 4, 9]]
    accepted = 0
    for temperature in (1.0, 0.1):  # at 0.1 the tiny model repeats itself, so n-gram drafts land
        config = dict(max_new_tokens=40, sampling=SamplingParams(do_sample=True, temperature=temperature), seed=5)
        reference = run(target, prompts, **config)
        results = run(target, prompts, NgramProposer(width=width), method="sd", num_draft_tokens=4, **config)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        accepted += sum(sum(r.stats.accepted_by_position) for r in results)
    assert accepted > 0  # drafts were accepted, not all missed


# -- stopping ----------------------------------------------------------------------------------


def first_mid_block_index(tokens: list[int], block: int, usable) -> int:
    """The first index i >= 2 with usable(i) that is not the last token of a step, when the prefill
    emits token 0 and every step emits ``block`` tokens (tokens 1..block, block+1..2*block, ...)."""
    for i in range(2, len(tokens)):
        if i % block != 0 and usable(i):
            return i
    raise AssertionError("the reference output has no usable position")


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_eos_mid_block_ends_generation_right_after_it(target, ar_reference, method: str) -> None:
    prompt = CASES[1][0]
    ref = ar_reference(prompt)
    k = 5  # with the target as draft, steps emit tokens [1..6], [7..12], ...
    i = first_mid_block_index(ref, k + 1, lambda i: ref[i] not in ref[:i])
    proposer = DraftModelProposer(ModelRunner(target)) if method == "sd" else None
    decoder = Decoder(ModelRunner(target), (ref[i],), proposer)
    [out] = decoder.generate([prompt], DecodeConfig(max_new_tokens=REF_TOKENS, method=method, num_draft_tokens=k))
    assert out.token_ids == ref[: i + 1]
    assert out.finish_reason == "eos"
    assert out.stats.new_tokens == i + 1
    # the last step verified tokens past the EOS; they were dropped and the statistics count what was emitted
    assert out.stats.accepted + out.stats.verify_steps + 1 == out.stats.new_tokens == i + 1
    if method == "sd":
        assert out.stats.proposed > out.stats.accepted
    assert_caches_empty(decoder)


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_eos_as_first_token(target, ar_reference, method: str) -> None:
    prompt = CASES[0][0]
    first = ar_reference(prompt)[0]
    out = run(target, [prompt], NgramProposer(), eos=(first,), max_new_tokens=10, method=method)[0]
    assert out.token_ids == [first]
    assert out.finish_reason == "eos"
    assert out.stats.target_forwards == 1


def detokenize(ids: list[int]) -> str:
    """One character per token, so text positions line up with tokens."""
    return "".join(chr(0x41 + t) for t in ids)


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_stop_string_ends_generation_at_the_token_completing_it(target, ar_reference, method: str) -> None:
    prompt = CASES[2][0]
    ref = ar_reference(prompt)
    text = detokenize(ref)
    i = first_mid_block_index(ref, 6, lambda i: text.find(text[i - 1 : i + 1]) == i - 1)
    stop = text[i - 1 : i + 1]
    proposer = DraftModelProposer(ModelRunner(target)) if method == "sd" else None
    out = run(
        target, [prompt], proposer, detokenize=detokenize, max_new_tokens=REF_TOKENS, method=method, stop=(stop,)
    )[0]
    assert out.token_ids == ref[: i + 1]
    assert out.finish_reason == "stop"
    # the last step verified tokens past the stop string; they were dropped and are not counted as accepted
    assert out.stats.accepted + out.stats.verify_steps + 1 == out.stats.new_tokens == i + 1
    assert out.stats.reached_by_position == out.stats.accepted_by_position or method == "ar"


@pytest.mark.parametrize("max_new", [1, 7, 9])
def test_max_new_tokens_is_exact_with_long_drafts(target, ar_reference, max_new: int) -> None:
    prompt = CASES[2][0]
    decoder = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(target)))
    [out] = decoder.generate([prompt], DecodeConfig(max_new_tokens=max_new, method="sd", num_draft_tokens=5))
    assert len(out.token_ids) == max_new
    assert out.token_ids == ar_reference(prompt)[:max_new]
    assert out.finish_reason == "length"
    # drafts never run past the budget, so nothing drafted is thrown away
    assert out.stats.proposed == out.stats.accepted == max_new - out.stats.verify_steps - 1
    assert_caches_empty(decoder)


# -- errors ------------------------------------------------------------------------------------


def test_stop_strings_need_a_detokenizer(target) -> None:
    with pytest.raises(ValueError, match="detokenizer"):
        run(target, [[1, 2]], max_new_tokens=4, stop=("x",))


def test_sd_needs_a_proposer(target) -> None:
    with pytest.raises(ValueError, match="proposer"):
        run(target, [[1, 2]], max_new_tokens=4, method="sd")


def test_empty_prompt_is_refused(target) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        run(target, [[1, 2], []], max_new_tokens=4)


def test_prompt_plus_max_new_tokens_must_fit_the_context(target) -> None:
    decoder = Decoder(ModelRunner(target, max_context=32))
    with pytest.raises(ValueError, match="context of 32"):
        decoder.generate([list(range(10))], DecodeConfig(max_new_tokens=23))
    [out] = decoder.generate([list(range(10))], DecodeConfig(max_new_tokens=22))
    assert len(out.token_ids) == 22


@pytest.mark.parametrize("field", ["max_new_tokens", "num_draft_tokens"])
def test_decode_config_validates_counts(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DecodeConfig(**{field: 0})


# -- sd samples from the target's distribution -----------------------------------------------

DIST_VOCAB = 4
DIST_PROMPT = [1, 2, 3]
# 4 tokens: the first comes from the prefill, then a step verifies a 2-token draft (k is capped
# at the tokens left minus the bonus), so draws exercise accepted, recovered and bonus tokens.
DIST_TOKENS = 4
DIST_STREAMS = 25  # streams per generate call; each stream is an independent draw


@torch.no_grad()
def exact_joint(model, prompt: list[int], n: int, top_k: int = 0, top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """P(t_1..t_n) = prod_i P(t_i | prompt, t_<i) under temperature-1 sampling, from HF logits; with ``top_k`` /
    ``top_p`` each row keeps its k likeliest tokens, then the likeliest whose more likely ones hold < top_p of the
    mass (the row's first always), renormalised (written here on its own, not spectot's ``target_probs``)."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        prefixes = list(probs)
        rows = torch.tensor([prompt + list(s) for s in prefixes], device=model.device)
        p = model(rows).logits[:, -1].double().softmax(-1).cpu()
        for row in p:
            order = sorted(range(DIST_VOCAB), key=lambda v: -float(row[v]))
            keep = order[:top_k] if top_k else order
            kept = row[keep] / row[keep].sum()
            ahead = torch.cumsum(kept, 0) - kept
            keep = [v for v, mass in zip(keep, ahead.tolist()) if mass < top_p or v == order[0]]
            truncated = torch.zeros_like(row)
            truncated[keep] = row[keep] / row[keep].sum()
            row.copy_(truncated)
        probs = {s + (v,): probs[s] * float(p[i, v]) for i, s in enumerate(prefixes) for v in range(DIST_VOCAB)}
    return {s: q for s, q in probs.items() if q > 0}


def sample_counts(
    decoder: Decoder, method: str, prompt: list[int], calls: int, sampling: SamplingParams = SAMPLE
) -> tuple[Counter, int, int]:
    """Seeds 0..calls-1, DIST_STREAMS copies of the prompt per call: counts of each token sequence,
    and the draft tokens proposed and accepted in all."""
    counts: Counter = Counter()
    proposed = accepted = 0
    for seed in range(calls):
        config = DecodeConfig(
            max_new_tokens=DIST_TOKENS, sampling=sampling, method=method, num_draft_tokens=2, seed=seed
        )
        for out in decoder.generate([prompt] * DIST_STREAMS, config):
            counts[tuple(out.token_ids)] += 1
            proposed += out.stats.proposed
            accepted += out.stats.accepted
    return counts, proposed, accepted


def chi_square_pvalue(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    """Pearson's test on every sequence, pooling the cells expected fewer than 5 times."""
    n = sum(counts.values())
    assert set(counts) <= set(exact)
    big = [s for s in exact if exact[s] * n >= 5]
    small = [s for s in exact if exact[s] * n < 5]
    observed = [counts[s] for s in big] + ([sum(counts[s] for s in small)] if small else [])
    expected = [exact[s] * n for s in big] + ([sum(exact[s] for s in small) * n] if small else [])
    total = sum(expected)
    return float(chisquare(observed, [e * n / total for e in expected]).pvalue)


def pair_tv(counts: Counter, exact: dict[tuple[int, ...], float], i: int) -> float:
    """Total variation between the empirical and exact joint of tokens i and i + 1."""
    n = sum(counts.values())
    emp: Counter = Counter()
    ref: Counter = Counter()
    for s, p in exact.items():
        ref[s[i : i + 2]] += p
        emp[s[i : i + 2]] += counts[s] / n
    return 0.5 * sum(abs(emp[pair] - ref[pair]) for pair in itertools.product(range(DIST_VOCAB), repeat=2))


@pytest.fixture(scope="module")
def dist_models(tiny_llama):
    # a wider init than the default makes the distributions far from uniform and far apart
    target = tiny_llama(TARGET_SEED, vocab_size=DIST_VOCAB, initializer_range=0.2)
    draft = tiny_llama(DRAFT_SEED, vocab_size=DIST_VOCAB, initializer_range=0.2)
    return target, draft


@pytest.fixture(scope="module")
def padded_draft(tiny_llama):
    """A draft whose head is padded past the tokens (rows DIST_VOCAB.. are no tokens, with random logits)."""
    return tiny_llama(DRAFT_SEED, vocab_size=DIST_VOCAB + 5, initializer_range=0.2)


@pytest.mark.parametrize(
    "draft, prompt, calls",
    [
        # sampled drafts, verified against their q
        pytest.param("model", DIST_PROMPT, 200, id="draft-model"),
        # k re-chosen every step from the outcomes so far (a short memory, so it keeps changing)
        pytest.param("model-adaptive", DIST_PROMPT, 200, id="draft-model-adaptive-k"),
        # a head padded to another width than the target's (one tokenizer): q over the tokens, on the target's rows
        pytest.param("model-padded", DIST_PROMPT, 200, id="draft-model-padded-head"),
        # deterministic drafts, verified as one-hot q (the prompt repeats, so lookups hit)
        pytest.param("ngram", [1, 2, 3, 1, 2], 120, id="ngram"),
        # each lookup cut to the k* of its matched n-gram length, learned as it goes
        pytest.param("ngram-adaptive", [1, 2, 3, 1, 2], 120, id="ngram-adaptive-k"),
        pytest.param("ngram-tree", [1, 2, 3, 1, 2, 0, 1, 3], 120, id="ngram-tree"),
    ],
)
def test_sd_sampling_matches_the_exact_target_joint(
    dist_models, padded_draft, draft: str, prompt: list[int], calls: int
) -> None:
    target, draft_model = dist_models
    exact = exact_joint(target, prompt, DIST_TOKENS)
    length = None
    if draft == "model-padded":
        proposer = DraftModelProposer(ModelRunner(padded_draft), tokens=DIST_VOCAB, target_rows=DIST_VOCAB)
    elif draft.startswith("model"):
        draft_exact = exact_joint(draft_model, prompt, DIST_TOKENS)
        assert 0.5 * sum(abs(exact[s] - draft_exact[s]) for s in exact) > 0.3  # the draft really differs
        proposer = DraftModelProposer(ModelRunner(draft_model))
        if draft == "model-adaptive":
            length = KChoices(lambda n: n**0.5, weight=0.5, decay=0.5, learn_cost=False)
    else:
        proposer = NgramProposer(width=3 if draft == "ngram-tree" else 1)
        if draft == "ngram-adaptive":
            length = KChoices(lambda n: n**0.5, weight=0.5, decay=0.5, learn_cost=False)

    decoder = Decoder(ModelRunner(target), (), proposer, draft_length=length)
    counts, proposed, accepted = sample_counts(decoder, "sd", prompt, calls)
    if length is not None:
        assert set(length.chosen) == {0, 1, 2}  # every k the budget allows was taken
    if draft == "ngram-adaptive":
        assert {match for _, match in length.estimates} >= {1, 2}  # 1- and 2-gram matches learned apart
    assert sum(counts.values()) == calls * DIST_STREAMS
    assert 0 < accepted < proposed  # both accepted and rejected drafts were verified
    assert chi_square_pvalue(counts, exact) > 1e-3
    for i in range(DIST_TOKENS - 1):
        assert pair_tv(counts, exact, i) < 0.05


class KChoices(DraftLength):
    """Records every k it picks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chosen: Counter = Counter()

    def choose(self, sampling, k_max, streams=1, match=None, members=None) -> int:
        k = super().choose(sampling, k_max, streams, match, members)
        self.chosen[k] += 1
        return k

    def choose_tree(self, sampling, k_max, streams=1, context=None, members=None, extra_rows=0) -> tuple[int, int]:
        k, width = super().choose_tree(sampling, k_max, streams, context, members, extra_rows)
        self.chosen[k] += 1
        return k, width


def test_ar_sampling_matches_the_exact_target_joint(dist_models) -> None:
    target, _ = dist_models
    exact = exact_joint(target, DIST_PROMPT, DIST_TOKENS)
    counts, proposed, _ = sample_counts(Decoder(ModelRunner(target)), "ar", DIST_PROMPT, calls=80)
    assert proposed == 0
    assert chi_square_pvalue(counts, exact) > 1e-3
    for i in range(DIST_TOKENS - 1):
        assert pair_tv(counts, exact, i) < 0.05


class GroupCalls(DraftLength):
    """Records (greedy group?, streams in the forward, of them in the group, rows earlier groups drafted) of
    each decision."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[bool, int, int | None, int]] = []

    def choose_tree(self, sampling, k_max, streams=1, context=None, members=None, extra_rows=0) -> tuple[int, int]:
        self.calls.append((sampling.greedy, streams, members, extra_rows))
        return super().choose_tree(sampling, k_max, streams, context, members, extra_rows)


def test_a_mixed_step_prices_each_sampling_group_by_its_own_streams(target, ar_reference) -> None:
    """A greedy stream beside two sampled ones: each group's k is chosen for its own streams, and the
    greedy stream still emits ar's tokens."""
    length = GroupCalls(lambda n: 1.0, learn_cost=False)  # rows free: both groups draft
    decoder = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(target)), draft_length=length)
    prompt, greedy = CASES[0][0], DecodeConfig(max_new_tokens=12, method="sd", num_draft_tokens=3)
    hot = DecodeConfig(max_new_tokens=12, method="sd", num_draft_tokens=3, sampling=SAMPLE)
    with decoder.session([prompt], greedy) as session:
        session.add([prompt, prompt], hot)
        session.prefill(session.streams)
        session.verify(session.streams, session.propose(session.streams))
        # the first group decided over one row a stream; the second also over the rows the first drafted
        assert [c[:3] for c in length.calls] == [(True, 3, 1), (False, 3, 2)] and length.calls[0][3] == 0
        assert length.calls[1][3] == session.streams[0].stats.proposed > 0
        active = [s for s in session.streams if s.finish is None]
        while active:
            session.verify(active, session.propose(active))
            active = [s for s in active if s.finish is None]
        results = session.results()
    assert results[0].token_ids == ar_reference(prompt)[:12]


def test_a_stop_string_longer_than_32_tokens_is_found() -> None:
    """hit_stop decodes the tail only; the tail grows with the longest stop string (a fixed 32 tokens missed one
    of 40 words)."""
    from spectot.spec.decoding import hit_stop

    words = [f"w{i % 60}" for i in range(100)]
    detokenize = lambda ids: " ".join(words[i] for i in ids)  # noqa: E731
    stop = " ".join(words[50:90])  # 40 tokens, ending in the newest one
    assert hit_stop(list(range(90)), [stop], detokenize)
    assert not hit_stop(list(range(89)), [stop], detokenize)


def test_a_step_that_only_fills_part_of_a_prompt_runs(target) -> None:
    """verify() with no stream decoding and one prompt chunk that does not finish its prompt wants no logits (it
    once failed selecting zero rows); filled chunk by chunk, the prompt then decodes as prefilled at once."""
    prompt, config = [1, *range(4, 24)], DecodeConfig(max_new_tokens=5)
    [expected] = Decoder(ModelRunner(target), ()).generate([prompt], config)
    decoder = Decoder(ModelRunner(target), ())
    with decoder.session([prompt], config) as session:
        [stream] = session.streams
        session.begin([stream])
        for _ in range(6):  # 3 + 3 + ... tokens a step: the prompt completes in the 7th
            session.verify([], [], [(stream, 3)])
        session.verify([], [], [(stream, 3)])
        while stream.finish is None:
            session.verify([stream], session.propose([stream]))
        [result] = session.results()
    assert result.token_ids == expected.token_ids


def test_a_padded_draft_head_keeps_ar_greedy(dist_models, padded_draft) -> None:
    target, _ = dist_models
    prompts = [DIST_PROMPT, [1, 2, 3, 1, 2]]
    want = [r.token_ids for r in run(target, prompts, max_new_tokens=12)]
    proposer = DraftModelProposer(ModelRunner(padded_draft), tokens=DIST_VOCAB, target_rows=DIST_VOCAB)
    got = run(target, prompts, proposer, max_new_tokens=12, method="sd", num_draft_tokens=3)
    assert [r.token_ids for r in got] == want and sum(r.stats.proposed for r in got) > 0


def test_the_depth_a_tree_step_reached_and_the_nodes_it_tested() -> None:
    """A shallow leaf accepted reached its own depth only (the tree's deepest was counted as reached and
    rejected, biasing acceptance by position low for fan trees and grafted branches); sampled siblings are
    tried one after another, so those after the accepted one were never tested (calibration counted them as
    rejected)."""
    from spectot.spec.decoding import _depth_reached, _tested

    fan = [-1, 0, 0, 1]  # root -> 1 -> 3, root -> 2
    assert _depth_reached(fan, [0, 2]) == 1
    assert _depth_reached(fan, [0, 1]) == 2  # node 3 was tested and rejected
    assert _depth_reached(fan, [0, 1, 3]) == 2
    assert _depth_reached(fan, [0]) == 1
    tree = [-1, 0, 0, 1, 1]
    assert _tested(tree, [0, 1], in_order=False) == [1, 2, 3, 4]
    assert _tested(tree, [0, 1], in_order=True) == [1, 3, 4]
    assert _tested(tree, [0, 2], in_order=True) == [1, 2]
    assert _tested(tree, [0], in_order=True) == [1, 2]  # all rejected: all tried


def test_stop_strings_are_checked() -> None:
    """A bare string stopped at each of its characters ('\\n\\n' cut at one newline); an empty one before the
    first token."""
    from spectot.backends.base import CompletionRequest

    with pytest.raises(ValueError, match=r"got the string '\\n\\n': pass \('\\n\\n',\)"):
        DecodeConfig(stop="\n\n")  # type: ignore[arg-type]
    for make in (lambda: DecodeConfig(stop=("x", "")), lambda: CompletionRequest("a", stop=("",))):
        with pytest.raises(ValueError, match="non-empty strings"):
            make()
    assert DecodeConfig(stop=("\n\n",)).stop == ("\n\n",)


def test_a_failed_shared_header_forward_leaks_no_slots(target, monkeypatch) -> None:
    """The stream forked for a header all prompts share ran before the guarded part: its forward failing left
    its forked slots held by nobody, for the runner's life."""
    runner = ModelRunner(target)
    decoder = Decoder(runner)
    header = [10 + (i % 50) for i in range(40)]
    decoder.generate([header[:18] + [5]], DecodeConfig(max_new_tokens=2))  # 18 header tokens now cached
    forward, calls = runner.forward, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory in the shared header's forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", failing_once)
    with pytest.raises(RuntimeError, match="shared header"):
        decoder.generate([header + [40, 41], header + [50, 51]], DecodeConfig(max_new_tokens=4))
    decoder.prefix_cache.clear()
    assert int((runner.cache.refcount > 0).sum()) == 0


def test_a_session_is_closed_once(target) -> None:
    """The continuous engine closes a failed step's session itself, then its ``with`` block closed it again:
    every draft stream was released twice, the second time keeping its draft KV for a step that failed."""
    released: list[int] = []

    class Counting(NgramProposer):
        def release(self, key: int, keep: bool = True) -> None:
            released.append(key)
            super().release(key, keep)

    decoder = Decoder(ModelRunner(target), proposer=Counting())
    with decoder.session([[5, 9, 2, 7]], DecodeConfig(method="sd", max_new_tokens=4)) as session:
        session.close(keep=False)
    assert len(released) == 1
    assert_caches_empty(decoder)


def test_a_draft_with_more_real_tokens_than_the_targets_head_is_refused() -> None:
    """Padding its q onto the target's rows cropped it (a q of 5 tokens on 4 rows summed to 0.8)."""
    with pytest.raises(ValueError, match="5 real tokens do not fit the target's 4 head rows"):
        DraftModelProposer(None, tokens=5, target_rows=4)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_sd_sampling_with_top_k_and_top_p_matches_the_truncated_target_joint(dist_models, draft: str) -> None:
    """The joint tests above sample at temperature 1 alone: here the target's rows are cut by top-k 3 and top-p 0.8
    (the draft's q, sampled under the same cut, puts mass where the target's cut rows put none, and is rejected
    there); sd's sequences follow the truncated target's joint, and none leaves its support."""
    target, draft_model = dist_models
    prompt = DIST_PROMPT if draft == "model" else [1, 2, 3, 1, 2]
    exact = exact_joint(target, prompt, DIST_TOKENS, top_k=3, top_p=0.8)
    assert len(exact) < DIST_VOCAB**DIST_TOKENS / 4  # the cut removes most sequences
    proposer = DraftModelProposer(ModelRunner(draft_model)) if draft == "model" else NgramProposer()
    sampling = SamplingParams(do_sample=True, temperature=1.0, top_k=3, top_p=0.8)
    counts, proposed, accepted = sample_counts(Decoder(ModelRunner(target), (), proposer), "sd", prompt, 80, sampling)
    assert 0 < accepted < proposed
    assert chi_square_pvalue(counts, exact) > 1e-3  # (its first assert: every sequence drawn is in the support)


def test_each_sampling_group_drafts_knowing_every_stream_of_the_forward(target) -> None:
    """The decoder drafts each sampling group in its own proposer call; a tree priced per forward (PCT) was told
    only its group's streams. ``DraftRequest.streams`` names the forward's."""

    class Seen(NgramProposer):
        def __init__(self) -> None:
            super().__init__()
            self.streams: list[int] = []

        def propose(self, requests, params, generator):
            self.streams += [r.streams for r in requests]
            return super().propose(requests, params, generator)

    proposer = Seen()
    prompt = CASES[0][0]
    greedy = DecodeConfig(max_new_tokens=4, method="sd", num_draft_tokens=3)
    hot = DecodeConfig(max_new_tokens=4, method="sd", num_draft_tokens=3, sampling=SAMPLE)
    with Decoder(ModelRunner(target), (), proposer).session([prompt], greedy) as session:
        session.add([prompt, prompt], hot)
        session.prefill(session.streams)
        session.propose(session.streams)
    assert proposer.streams == [3, 3, 3]  # two calls (one a group), each told the forward's 3 streams


def test_a_completion_reads_after_its_prompt() -> None:
    """Decoded alone, a SentencePiece completion lost its leading space (" w7 w8" after "w5 w6" came back
    "w7 w8": the search's next prompt read "w5 w6w7 w8") and a stop string opening with a space could not match on
    the first token; read after the prompt's last tokens, both hold, and a stop string in the prompt alone does
    not count."""
    from conftest import build_metaspace_tokenizer

    from spectot.spec.decoding import decode_after, hit_stop

    tokenizer = build_metaspace_tokenizer()
    detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompt, generated = tokenizer("w1 w2 w3 w4 w5 w6")["input_ids"], tokenizer("w7 w8")["input_ids"]
    assert detokenize(generated) == "w7 w8"  # the tokenizer's start-of-text rule
    assert decode_after(detokenize, prompt, generated) == " w7 w8"
    assert decode_after(detokenize, prompt[:1], generated) == " w7 w8"  # a context shorter than CONTEXT_TOKENS
    assert decode_after(detokenize, [], generated) == "w7 w8"
    assert hit_stop(generated[:1], [" w7"], detokenize, prompt)
    assert not hit_stop(generated[:1], [" w7"], detokenize)  # as it was
    assert not hit_stop(generated[:1], ["w5 w6"], detokenize, prompt)


def test_an_empty_prompt_is_a_refusal_of_its_own(target) -> None:
    """An empty prompt raised a plain ValueError, so a search ended the whole run on it, where every other prompt
    the decoder cannot run fails its query alone."""
    from spectot.backends.base import is_refusal
    from spectot.spec.decoding import PromptRefused

    with pytest.raises(PromptRefused, match="at least one token") as refused:
        run(target, [[5, 9], []], max_new_tokens=2)
    assert is_refusal(refused.value)
