"""Adaptive draft length: G(k), k* on hand-made curves, the online estimate, and the decoder using it
(greedy output unchanged, drafts switched off where they cannot pay, on again where they can)."""

from __future__ import annotations

import pytest

from spectot.engine.runner import ModelRunner
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.draft_length import (
    AcceptanceEstimate,
    DraftLength,
    ForwardTime,
    best_chain_length,
    best_fan_chain,
    chain_tokens,
    fan_chain_outcome,
)
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
    for _ in range(200):
        estimate.step()
    assert low < 0.1 and estimate.alpha(1)[0] == pytest.approx(0.5, abs=0.01)


def test_a_draft_switched_off_by_a_low_prior_is_probed_again() -> None:
    """The prior's weight decays with the counts: with nothing observed the bound widens to 1, so a prior far
    below the true rate (0.05 against 0.6) cannot keep the draft off for good; it kept the bound at 0.2."""
    estimate = AcceptanceEstimate(prior=0.05, weight=2.0, decay=0.98)
    assert estimate.optimistic(1, 1.0)[0] < 0.25
    for _ in range(300):
        estimate.step()
    assert estimate.optimistic(1, 1.0)[0] == 1.0
    assert estimate.alpha(1)[0] == pytest.approx(0.05)  # its mean is still the prior's
    for _ in range(100):  # probed: the true rate shows
        estimate.observe(proposed=1, accepted=1 if _ % 5 < 3 else 0)
        estimate.step()
    assert estimate.alpha(1)[0] == pytest.approx(0.6, abs=0.08)


def test_a_prior_of_zero_does_not_switch_drafting_off_for_good() -> None:
    """At m = 0 the optimistic bound m + z sqrt(m (1 - m) / n) is 0 however the prior's weight decays: k* = 0 for
    ever, nothing observed, the prior never moved (bench trees wrote 0.0 for a rank measured on no visits)."""
    curve = lambda n: 1.0 + 0.02 * (n - 1)  # noqa: E731
    length = DraftLength(curve, 0.01, priors={0.0: 0.0})
    assert {length.choose(GREEDY, 4) for _ in range(5000)} != {0}


def test_runners_up_past_the_measured_vector_are_not_the_last_ones_again() -> None:
    """P_2 = 0.2 measured, width 8: P_3..P_8 repeated 0.2 (1.4 of extra acceptance) and the widest fan won;
    Sequoia's DP reads them as 0."""
    curve = lambda n: 1.0 + 0.01 * (n - 1)  # noqa: E731
    length = DraftLength(curve, 0.01, priors={0.0: 0.3}, max_width=8, runner_up_priors={0.0: [0.2]}, optimism=0.0)
    assert length.runner_up_priors[0.0][0] == 0.2 and max(length.runner_up_priors[0.0][1:]) <= 1e-3
    assert length.choose_tree(GREEDY, 4)[1] <= 2
    # no vector measured (the VDM, a train-draft folder): the default guess stands for every rank, so wide fans
    # stay possible and get observed (padded near 0 they were never drafted, never observed)
    rows = lambda n: 1.0 + 0.005 * (n - 1)  # noqa: E731  (a row costs more than 1e-3 of a token is worth)
    unmeasured = DraftLength(rows, 0.05, priors={0.0: 0.7}, max_width=4)
    assert unmeasured.choose_tree(GREEDY, 8) == (8, 4)


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


def test_draft_cost_is_learnt_per_stream_count() -> None:
    """A draft forward for three streams (their catch-ups, their host work) costs more than for one: each count
    keeps its own d, a count never seen takes the nearest one's, and only the dear one stops drafting."""
    length = DraftLength(flat, draft_cost=0.0, priors={1.0: 0.5}, optimism=0.0, smoothing=1.0)
    length.observe_verify(0.010, 4)  # u = 10 ms
    length.observe_draft(0.001, 1, streams=1)  # d(1) = 1 ms
    length.observe_draft(0.010, 1, streams=3)  # a count's first: capped at 4 d(1), its nearest -> d(3) = 4 ms
    assert length.draft_seconds(3) == pytest.approx(0.004)
    length.observe_draft(0.010, 1, streams=3)  # d(3) = 10 ms: a whole target step
    assert length.cost_for(1) == pytest.approx(0.1) and length.cost_for(3) == pytest.approx(1.0)
    assert length.cost_for(2) == pytest.approx(1.0) and length.cost_for(8) == pytest.approx(1.0)  # nearest
    assert length.cost == pytest.approx(0.1)
    assert length.choose(HOT, 5, streams=1) > 0
    assert length.choose(HOT, 5, streams=3) == 0
    assert length.choose_tree(HOT, 5, streams=3) == (0, 1)


def test_forward_time_starts_at_the_profile_and_fits_the_engines_forwards() -> None:
    """Prior only: the profile's points (one stream after 256 tokens). Then forwards of many shapes timed from a
    known law s = 9 ms + 0.8 ms a row + 1 ms per 1k context tokens + 1 ms per 1k row-tokens: recovered to 1 %."""
    import random

    model = ForwardTime([(1, 0.010), (8, 0.017)], context=256)
    assert model.seconds(1, 256, 256) == pytest.approx(0.010, rel=1e-3)
    assert model.seconds(8, 256, 8 * 256) == pytest.approx(0.017, rel=1e-3)
    # whatever the context, as the docstring says (the prior's context terms were a minimum-norm split: one row
    # priced 0.0094 s at no context and 0.0190 s at 4,000 tokens)
    for k in (0, 1000, 4000):
        assert model.seconds(1, k, k) == pytest.approx(0.010, rel=1e-3)
        assert model.seconds(8, k, 8 * k) == pytest.approx(0.017, rel=1e-3)
    law = lambda n, k, r: 0.009 + 0.0008 * n + 0.001 * k / 1000 + 0.001 * r / 1000  # noqa: E731
    rng = random.Random(0)
    for _ in range(400):
        streams = rng.randint(1, 4)
        contexts = [rng.randint(200, 900) for _ in range(streams)]
        rows = [rng.randint(1, 5) for _ in range(streams)]
        work = sum(r * c for r, c in zip(rows, contexts))
        model.observe(law(sum(rows), sum(contexts), work), sum(rows), sum(contexts), work)
    for n, k, r in [(1, 650, 650), (5, 650, 3250), (8, 2000, 4000), (16, 2400, 9600)]:
        assert model.seconds(n, k, r) == pytest.approx(law(n, k, r), rel=0.01)


def test_a_forward_time_prices_rows_at_what_the_engine_measured() -> None:
    """The profile says rows are nearly free, so two streams draft at alpha = 0.5; the engine's forwards after
    long contexts cost 2 ms a row and 10 ms per 1k row-tokens: with the streams' context given, the same
    evidence takes no draft. Without a context (or with ``learn_cost=False``) t_0 decides as before."""
    profile = [(1, 0.010), (2, 0.0101), (4, 0.0103), (8, 0.0107)]
    model = ForwardTime(profile, context=256, gamma=1.0)
    length = DraftLength(lambda n: 1.0 + 0.01 * (n - 1), 0.05, priors={1.0: 0.5}, optimism=0.0, forward_time=model)
    assert length.choose_tree(HOT, 1, streams=2, context=1400) == (1, 1)
    rng = __import__("random").Random(1)
    for _ in range(200):
        b = rng.randint(1, 4)
        rows, context = b * rng.randint(1, 3), b * rng.randint(500, 800)
        work = rows // b * context
        length.observe_verify(0.010 + 0.002 * rows + 0.010 * work / 1000, rows, context, work)
    assert length.choose_tree(HOT, 1, streams=2, context=1400) == (0, 1)
    assert length.choose_tree(HOT, 1, streams=2) == (1, 1)  # no context: the profile's t_0


def test_best_fan_chain_by_hand() -> None:
    """alpha_1 = 0.25, runners-up P_2 = 0.2, P_3 = 0.1, t(n) = 1 + 0.05 (n - 1), c = 0.1. One stream:
    no draft 1, (k, w) = (1, 1) 1.25 / 1.15 = 1.09, (1, 2) 1.45 / 1.2 = 1.21, (1, 3) 1.55 / 1.25 = 1.24 -> (1, 3).
    Four streams: 1 / 1.15 = 0.87 against 1.25 / 1.45 = 0.86, 1.45 / 1.65 = 0.88, 1.55 / 1.85 = 0.84 -> (1, 2)."""
    curve = lambda n: 1.0 + 0.05 * (n - 1)  # noqa: E731
    assert best_fan_chain([0.25], [0.2, 0.1], 1, 3, curve, 0.1) == (1, 3)
    assert best_fan_chain([0.25], [0.2, 0.1], 1, 3, curve, 0.1, streams=4) == (1, 2)
    assert best_fan_chain([0.25], [0.2, 0.1], 1, 1, curve, 0.1) == (1, 1)  # w_max = 1: the chain rule
    assert best_chain_length([0.25], 1, curve, 0.1) == 1
    assert best_fan_chain([0.0], [0.0, 0.0], 1, 3, curve, 0.1) == (0, 1)  # nothing lands: no draft
    # a draft that lands its first guess: the chain, not the runners-up (they cost rows and add 0.01 each)
    assert best_fan_chain([0.9] * 3, [0.01, 0.01], 3, 3, curve, 0.1) == (3, 1)


def test_a_group_of_the_streams_is_priced_by_its_own_rows() -> None:
    """t(n) = 1 up to 5 rows, then + 0.25 a row; alpha_1 = 0.6, c = 0.05, four streams in the forward. All four
    drafting one token: 4 x 1.6 / (t(8) + 0.05) = 3.56 tokens a unit against 4 / t(4) = 4: no draft. One of
    them drafting (a greedy evaluation beside three sampled thoughts): (3 + 1.6) / (t(5) + 0.05) = 4.38: draft.
    Before, the one was priced as if all four drafted."""
    curve = lambda n: 1.0 + 0.25 * max(0.0, n - 5)  # noqa: E731
    assert best_fan_chain([0.6], [], 1, 1, curve, 0.05, streams=4) == (0, 1)
    assert best_fan_chain([0.6], [], 1, 1, curve, 0.05, streams=4, members=4) == (0, 1)
    assert best_fan_chain([0.6], [], 1, 1, curve, 0.05, streams=4, members=1) == (1, 1)
    length = DraftLength(curve, 0.05, priors={1.0: 0.6}, optimism=0.0, learn_cost=False)
    assert length.choose_tree(HOT, 1, streams=4) == (0, 1)
    assert length.choose_tree(HOT, 1, streams=4, members=1) == (1, 1)
    # another group's draft took the fifth row: the one's row now costs 0.25, (3 + 1.6) / 1.3 = 3.54 < 4 / 1
    assert best_fan_chain([0.6], [], 1, 1, curve, 0.05, streams=4, members=1, extra_rows=1) == (0, 1)
    assert length.choose(HOT, 1, streams=4) == 0 and length.choose(HOT, 1, streams=4, members=1) == 1
    for bad in (dict(members=0), dict(members=5), dict(members=1, extra_rows=-1)):
        with pytest.raises(ValueError, match="drafted streams"):
            best_fan_chain([0.6], [], 1, 1, curve, 0.05, streams=4, **bad)


def test_fan_chain_outcome_reads_ranks_chain_and_grafts() -> None:
    fan = [-1, -1, -1, 0, 3]  # fan_chain_tree(3, 3) as a draft's parents (the root is -1)
    assert fan_chain_outcome(fan, 5, 3, [0, 1, 4]) == (3, 2, 1)  # rank 1 and the chain's next token
    assert fan_chain_outcome(fan, 5, 3, [0, 3]) == (3, 0, 3)  # the third candidate
    assert fan_chain_outcome(fan, 5, 3, [0]) == (3, 0, 0)  # nothing accepted
    assert fan_chain_outcome(None, 4, 1, [0, 1, 2, 3, 4]) == (4, 4, 1)  # a plain chain
    assert fan_chain_outcome([-1, 0, 1, -1], 4, 1, [0, 4]) == (3, 0, 0)  # a grafted lookup token won
    assert fan_chain_outcome([-1, -1], 2, 2, [0, 1]) == (1, 1, 1)  # k = 1: the fan only


def test_runners_up_are_learnt_and_switch_the_fan_on_and_off() -> None:
    """t(n) = 1 + 0.05 (n - 1), c = 0.1, a first guess that never lands. The prior (alpha_1 = 0.3, P_2 = P_3 =
    0.1) takes the fan of 3 (1.5 / 1.25 = 1.2, the best of k <= 2, w <= 3); once the second candidate is seen to
    land every time, the fan of 2 (1.98 / 1.2 against 1.98 / 1.25 with the third); once nothing lands, no draft."""
    curve = lambda n: 1.0 + 0.05 * (n - 1)  # noqa: E731
    options = dict(priors={1.0: 0.3}, optimism=0.0, learn_cost=False)
    length = DraftLength(curve, 0.1, max_width=3, runner_up_priors={1.0: [0.1, 0.1]}, **options)
    assert length.choose_tree(HOT, 2) == (1, 3)
    for _ in range(60):
        length.observe(HOT, proposed=1, accepted=0, width=3, rank=2)
    assert length.runners_up[HOT].alpha(2) == [pytest.approx(60.2 / 62), pytest.approx(0.2 / 62)]
    assert length.choose_tree(HOT, 2) == (1, 2)
    for _ in range(600):
        length.observe(HOT, proposed=1, accepted=0, width=3, rank=None)
    assert length.choose_tree(HOT, 2) == (0, 1)
    assert DraftLength(curve, 0.1, **options).choose_tree(HOT, 2) == (1, 1)  # max_width 1: the chain rule


@pytest.mark.parametrize(
    "bad",
    [
        dict(draft_cost=-1.0),
        dict(weight=0.0),
        dict(decay=0.0),
        dict(optimism=-1.0),
        dict(priors={0.0: 1.5}),
        dict(smoothing=0.0),
        dict(max_width=0),
        dict(runner_up_priors={0.0: [1.5]}),
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
    never = DraftLength(flat, draft_cost=10.0, learn_cost=False)  # a draft step costing ten target steps
    [chain] = Decoder(ModelRunner(target), (), NgramProposer(), draft_length=never).generate([prompt], config)
    [tree] = Decoder(ModelRunner(target), (), NgramProposer(width=3), draft_length=never).generate([prompt], config)
    assert chain.stats.proposed == 0 and tree.stats.proposed > 0
    assert chain.token_ids == tree.token_ids


@pytest.mark.parametrize(
    "seconds, width",
    [
        ({1: 0.0211, 2: 0.0225, 4: 0.0237, 8: 0.0228}, 4),  # an H200's profile (session 21): rows nearly free
        ({1: 0.0110, 2: 0.0118, 4: 0.0129, 8: 0.0146}, 1),  # a 2-core Zen 5's: t(8) = 1.33 t(1)
        ({1: 0.0110, 2: 0.0112, 4: 0.0150}, 1),  # no 8-row point: the largest measured count decides
        ({2: 0.0112, 8: 0.0114}, 1),  # no one-row point: nothing to compare, chains
    ],
)
def test_default_fan_width_follows_the_row_cost(seconds: dict, width: int) -> None:
    from spectot.pipeline import fan_width

    assert fan_width([{"n": n, "t": s / seconds.get(1, s), "seconds": s} for n, s in seconds.items()]) == width


def test_draft_width_must_not_be_negative() -> None:
    from spectot.config import DraftOptions

    assert DraftOptions().draft_width == 0  # by the machine's t(n)
    with pytest.raises(ValueError, match="--draft-width counts candidates"):
        DraftOptions(draft_width=-1)
