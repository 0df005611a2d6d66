"""Adaptive draft length: G(k), k* on hand-made curves, the online estimate, and the decoder using it
(greedy output unchanged, drafts switched off where they cannot pay, on again where they can)."""

from __future__ import annotations

import pytest

from spectot.engine.runner import ModelRunner
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.draft_length import AcceptanceEstimate, DraftLength, best_chain_length, chain_tokens
from spectot.spec.proposers.draft_model import DraftModelProposer
from spectot.spec.proposers.ngram import NgramProposer
from spectot.spec.sampling import SamplingParams

GREEDY = SamplingParams()
HOT = SamplingParams(do_sample=True, temperature=1.0)


def kinked(n: float) -> float:
    """t(n) = 1 up to 2 rows, then 0.25 per row: the docstring's worked example."""
    return 1.0 if n <= 2 else 1.0 + 0.25 * (n - 2)


def linear(n: float) -> float:
    """Every row costs a full row: a compute-bound batch."""
    return float(n)


def flat(n: float) -> float:
    return 1.0


def test_chain_tokens_by_hand() -> None:
    assert chain_tokens([0.8, 0.5, 0.5], 0) == 1.0
    assert chain_tokens([0.8, 0.5, 0.5], 1) == pytest.approx(1.8)
    assert chain_tokens([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert chain_tokens([1.0] * 4, 4) == 5.0


def test_best_chain_length_on_hand_made_curves() -> None:
    assert best_chain_length([0.8, 0.5, 0.5], 3, kinked, 0.0) == 1  # 1, 1.8, 1.76, 1.6
    assert best_chain_length([0.9] * 5, 5, flat, 0.0) == 5  # free rows: draft all of them
    assert best_chain_length([0.9] * 5, 5, flat, 0.5) == 3  # 1, 1.27, 1.36, 1.38, 1.37: a draft step costs
    assert best_chain_length([0.0] * 5, 5, flat, 0.0) == 0  # nothing accepted: ties go to no draft
    # 8 streams on a compute-bound curve: G(k) <= k + 1 rows never beats plain decoding
    assert best_chain_length([0.9] * 5, 5, linear, 0.0, streams=8) == 0
    assert best_chain_length([0.9] * 5, 0, flat, 0.0) == 0  # no room left in the budget


def test_estimate_starts_at_the_prior_and_learns() -> None:
    estimate = AcceptanceEstimate(prior=0.5, weight=2.0, decay=1.0)
    assert estimate.alpha(3) == [0.5, 0.5, 0.5]
    estimate.observe(proposed=3, accepted=1)  # position 1 accepted, 2 rejected, 3 never tested
    assert estimate.alpha(3) == [pytest.approx(2 / 3), pytest.approx(1 / 3), 0.5]
    for _ in range(200):
        estimate.observe(proposed=5, accepted=0)
    assert estimate.alpha(1)[0] < 0.01


def test_decay_drifts_back_to_the_prior() -> None:
    estimate = AcceptanceEstimate(prior=0.5, weight=2.0, decay=0.9)
    for _ in range(50):
        estimate.observe(proposed=2, accepted=0)
    low = estimate.alpha(1)[0]
    for _ in range(100):
        estimate.step()
    assert low < 0.1 and estimate.alpha(1)[0] == pytest.approx(0.5, abs=0.01)


def test_draft_length_keeps_an_estimate_per_sampling_and_uses_the_nearest_prior() -> None:
    length = DraftLength(lambda n: 1 + 0.5 * (n - 1), priors={0.0: 0.9, 1.0: 0.0})  # k = 1 needs alpha_1 > 0.5
    assert length.choose(GREEDY, 5) >= 1
    assert length.choose(HOT, 5) == 0  # the temperature-1 prior says the draft never lands
    for _ in range(30):
        length.observe(GREEDY, proposed=5, accepted=0)
    assert length.choose(GREEDY, 5) == 0
    assert set(length.estimates) == {(GREEDY, None), (HOT, None)}
    # skipped steps decay the evidence: the bound widens until the draft is probed again
    assert any(length.choose(GREEDY, 5) >= 1 for _ in range(200))
    assert all(length.choose(HOT, 5) == 0 for _ in range(200))  # a sure 0 never widens


def test_optimistic_bound_shrinks_with_evidence() -> None:
    estimate = AcceptanceEstimate(prior=0.5, weight=2.0, decay=1.0)
    assert estimate.optimistic(1, 1.0)[0] == pytest.approx(0.5 + (0.25 / 2) ** 0.5)
    for _ in range(98):
        estimate.observe(proposed=1, accepted=0)
    assert estimate.alpha(1)[0] == pytest.approx(0.01)
    assert estimate.optimistic(1, 1.0)[0] == pytest.approx(0.01 + (0.01 * 0.99 / 100) ** 0.5)
    assert estimate.optimistic(1, 0.0) == estimate.alpha(1)


def test_each_evidence_class_learns_its_own_acceptance() -> None:
    """Prompt lookup's 1-gram guesses miss and its 3-gram copies land: each class gets its own k*."""
    length = DraftLength(lambda n: 1 + 0.5 * (n - 1))  # each drafted row costs half a step
    for _ in range(40):
        length.observe(HOT, proposed=4, accepted=0, match=1)
        length.observe(HOT, proposed=4, accepted=4, match=3)
    assert length.choose(HOT, 4, match=1) == 0
    assert length.choose(HOT, 4, match=3) == 4
    assert set(length.estimates) == {(HOT, 1), (HOT, 3)}


def test_draft_cost_is_learnt_from_measured_steps() -> None:
    """c = d / u: seconds per draft forward over seconds per unit of t, moving averages from the engine's steps."""
    length = DraftLength(kinked, draft_cost=0.05, smoothing=0.5)
    assert length.cost == 0.05  # nothing measured yet: the offline profile's
    length.observe_draft(0.004, 2)  # d = 2 ms a draft forward
    assert length.cost == 0.05  # no target step seen yet
    length.observe_verify(0.015, 6)  # t(6) = 2: u = 7.5 ms
    assert length.cost == pytest.approx(0.002 / 0.0075)
    length.observe_verify(0.010, 1)  # u <- 7.5 + 0.5 (10 - 7.5) = 8.75 ms
    assert length.cost == pytest.approx(0.002 / 0.00875)
    length.observe_draft(1.0, 1)  # a prompt catch-up: capped at 4 d -> d = 2 + 0.5 (8 - 2) = 5 ms
    assert length.cost == pytest.approx(0.005 / 0.00875)
    length.observe_draft(0.5, 0)  # no draft forward ran: nothing to learn
    assert length.cost == pytest.approx(0.005 / 0.00875)
    fixed = DraftLength(kinked, draft_cost=0.05, learn_cost=False)
    fixed.observe_draft(0.004, 2)
    fixed.observe_verify(0.015, 6)
    assert fixed.cost == 0.05


def test_a_draft_measured_expensive_is_switched_off() -> None:
    """Offline c = 0 drafts k = 5 on free rows; measured, a draft forward costing a whole target step does not pay
    at alpha = 0.5 (G(k) / (1 + k) < 1), so k* falls to 0."""
    length = DraftLength(flat, draft_cost=0.0, priors={1.0: 0.5}, optimism=0.0)
    assert length.choose(HOT, 5) == 5
    length.observe_verify(0.010, 4)
    length.observe_draft(0.010, 1)
    assert length.choose(HOT, 5) == 0


def test_t_is_corrected_by_the_forwards_the_engine_times() -> None:
    """The profile says rows are free (flat t_0), so two streams draft; the engine's forwards of 4 rows take
    twice those of 2 (several streams' contexts to read): once ``min_seen`` of each were timed, t(4) / t(2) = 2
    and at alpha = 0.5, G(1) / T(1) = 1.5 / 2 < 1, so k* falls to 0."""
    length = DraftLength(flat, priors={1.0: 0.5}, optimism=0.0, min_seen=3)
    assert length.choose(HOT, 1, streams=2) == 1
    for _ in range(2):
        length.observe_verify(0.010, 2)
        length.observe_verify(0.020, 4)
    assert length.t(4) == length.t(2) == 1.0  # seen twice each: the profile still
    assert length.choose(HOT, 1, streams=2) == 1
    length.observe_verify(0.010, 2)
    length.observe_verify(0.020, 4)
    assert length.t(4) / length.t(2) == pytest.approx(2.0)
    assert length.t(8) == 1.0  # never timed: t_0
    assert length.choose(HOT, 1, streams=2) == 0
    pinned = DraftLength(flat, priors={1.0: 0.5}, optimism=0.0, min_seen=1, learn_cost=False)
    pinned.observe_verify(0.010, 2)
    pinned.observe_verify(0.020, 4)
    assert pinned.t(4) == 1.0 and pinned.choose(HOT, 1, streams=2) == 1


@pytest.mark.parametrize(
    "bad",
    [
        dict(draft_cost=-1.0),
        dict(weight=0.0),
        dict(decay=0.0),
        dict(optimism=-1.0),
        dict(priors={0.0: 1.5}),
        dict(smoothing=0.0),
        dict(min_seen=0),
    ],
)
def test_draft_length_validates(bad: dict) -> None:
    with pytest.raises(ValueError):
        DraftLength(flat, **bad)


# -- in the decoder ----------------------------------------------------------------------------

PROMPTS = [[3, 17, 42, 8], [21, 9, 60, 2, 2, 14, 33, 7, 50, 11, 38]]


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(0)


def test_adaptive_sd_is_greedy_lossless_and_stops_drafting_a_hopeless_draft(target, tiny_llama) -> None:
    reference = Decoder(ModelRunner(target)).generate(PROMPTS, DecodeConfig(max_new_tokens=40))
    config = DecodeConfig(max_new_tokens=40, method="sd", num_draft_tokens=4)
    fixed = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(tiny_llama(1)))).generate(PROMPTS, config)
    length = DraftLength(kinked, learn_cost=False)  # the acceptance alone switches it off
    decoder = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(tiny_llama(1))), draft_length=length)
    adaptive = decoder.generate(PROMPTS, config)
    assert [r.token_ids for r in adaptive] == [r.token_ids for r in reference]
    # an unrelated random draft is rejected: the estimate falls and most steps skip it
    assert sum(r.stats.proposed for r in adaptive) < sum(r.stats.proposed for r in fixed) / 4
    assert length.estimates[(GREEDY, None)].alpha(1)[0] < 0.3


def test_adaptive_sd_keeps_drafting_a_draft_that_lands(target) -> None:
    """The target as its own draft: every token accepted, so k stays at its maximum on free rows."""
    config = DecodeConfig(max_new_tokens=30, method="sd", num_draft_tokens=4)
    reference = Decoder(ModelRunner(target)).generate(PROMPTS, config.__class__(max_new_tokens=30))
    # a draft as costly as its target never pays: keep the cost model's free draft
    length = DraftLength(flat, learn_cost=False)
    decoder = Decoder(ModelRunner(target), (), DraftModelProposer(ModelRunner(target)), draft_length=length)
    outs = decoder.generate(PROMPTS, config)
    assert [r.token_ids for r in outs] == [r.token_ids for r in reference]
    assert all(r.stats.mean_acceptance_length > 4 for r in outs)


def test_adaptive_sd_with_prompt_lookup_matches_ar(target) -> None:
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats, so lookups find something
    [ref] = Decoder(ModelRunner(target)).generate([prompt], DecodeConfig(max_new_tokens=40))
    decoder = Decoder(ModelRunner(target), (), NgramProposer(), draft_length=DraftLength(kinked))
    [out] = decoder.generate([prompt], DecodeConfig(max_new_tokens=40, method="sd"))
    assert out.token_ids == ref.token_ids


def test_prompt_lookup_is_cut_by_its_match_length(target) -> None:
    """A lookup is drafted in full, then cut to its class's k*: a class that never lands stops drafting
    while the others go on, and the output is still the target's own."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 5, 6, 7]
    [ref] = Decoder(ModelRunner(target)).generate([prompt], DecodeConfig(max_new_tokens=40))
    length = DraftLength(flat)
    decoder = Decoder(ModelRunner(target), (), NgramProposer(), draft_length=length)
    [out] = decoder.generate([prompt], DecodeConfig(max_new_tokens=40, method="sd", num_draft_tokens=4))
    assert out.token_ids == ref.token_ids
    assert out.stats.proposed > 0
    assert {match for _, match in length.estimates} <= {1, 2, 3} and length.estimates


def test_only_chain_drafts_adapt(target) -> None:
    """A length that always says k* = 0 silences a chain draft, never a tree draft (its size is its own rule)."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    config = DecodeConfig(max_new_tokens=20, method="sd")
    never = DraftLength(flat, priors={0.0: 0.0})
    [chain] = Decoder(ModelRunner(target), (), NgramProposer(), draft_length=never).generate([prompt], config)
    [tree] = Decoder(ModelRunner(target), (), NgramProposer(width=3), draft_length=never).generate([prompt], config)
    assert chain.stats.proposed == 0 and tree.stats.proposed > 0
    assert chain.token_ids == tree.token_ids
