"""DecodeStats on a hand-made sequence of verification steps.

Steps (proposed, accepted): (3, 3), (3, 1), (0, 0), (2, 0), (4, 2)
- emitted per step (accepted + the recovered/bonus token): 4, 2, 1, 1, 3 -> 11 tokens in 5 steps
- proposed by position 1..4: 4, 4, 3, 1; accepted by position: 3, 2, 1, 0
"""

from __future__ import annotations

import pytest

from spectot.spec.stats import DecodeStats

STEPS = [(3, 3), (3, 1), (0, 0), (2, 0), (4, 2)]


def recorded(steps: list[tuple[int, int]]) -> DecodeStats:
    stats = DecodeStats()
    for proposed, accepted in steps:
        stats.record_step(proposed, accepted)
    return stats


def test_record_step_totals() -> None:
    stats = recorded(STEPS)
    assert (stats.verify_steps, stats.proposed, stats.accepted) == (5, 12, 6)


def test_record_step_counts_by_position() -> None:
    stats = recorded(STEPS)
    # position i counts only when it was tested: proposed, and drafts 1..i-1 accepted
    assert stats.reached_by_position == [4, 3, 2]
    assert stats.accepted_by_position == [3, 2, 1]


def test_mean_acceptance_length_includes_bonus_token() -> None:
    assert recorded(STEPS).mean_acceptance_length == pytest.approx(11 / 5)


def test_step_without_draft_emits_one_token() -> None:
    stats = recorded([(0, 0)] * 3)  # plain AR
    assert stats.mean_acceptance_length == 1.0
    assert stats.acceptance_rate == 0.0
    assert stats.to_dict()["acceptance_by_position"] == []


def test_acceptance_rate() -> None:
    assert recorded(STEPS).acceptance_rate == pytest.approx(6 / 12)


def test_acceptance_by_position_first_position() -> None:
    # position 1 has no earlier drafts to condition on: 3 of the 4 proposed first tokens were accepted
    assert recorded(STEPS).to_dict()["acceptance_by_position"][0] == pytest.approx(3 / 4)


def test_acceptance_by_position_is_conditional_on_earlier_acceptance() -> None:
    # position 2 was reached (proposed with draft 1 accepted) in steps (3, 3), (3, 1), (4, 2): 3 times;
    # draft 2 was accepted in 2 of them. Position 3: reached in (3, 3) and (4, 2) (which tested and
    # rejected draft 3): accepted once. Position 4 was never reached, so it has no entry.
    assert recorded(STEPS).to_dict()["acceptance_by_position"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])


def test_empty_stats_are_zero_not_nan() -> None:
    stats = DecodeStats()
    assert (stats.mean_acceptance_length, stats.acceptance_rate, stats.tokens_per_second) == (0.0, 0.0, 0.0)


def test_time_other_is_the_rest_and_never_negative() -> None:
    stats = DecodeStats(time_draft=1.0, time_verify=2.5, time_total=4.0)
    assert stats.time_other == pytest.approx(0.5)
    assert DecodeStats(time_draft=1.0, time_verify=2.0, time_total=2.5).time_other == 0.0


def test_tokens_per_second() -> None:
    assert DecodeStats(new_tokens=30, time_total=2.0).tokens_per_second == pytest.approx(15.0)


def test_to_dict_has_fields_and_derived_metrics() -> None:
    stats = recorded(STEPS)
    stats.new_tokens, stats.time_total = 11, 2.0
    out = stats.to_dict()
    assert out["reached_by_position"] == [4, 3, 2]
    assert out["mean_acceptance_length"] == pytest.approx(2.2)
    assert out["acceptance_rate"] == pytest.approx(0.5)
    assert out["tokens_per_second"] == pytest.approx(5.5)
    assert out["time_other"] == pytest.approx(2.0)
    assert len(out["acceptance_by_position"]) == 3


def test_the_acceptance_vector_counts_rank_r_where_a_rank_r_child_was_drafted() -> None:
    """Sequoia's p_r: a node of one child says nothing of rank 2. Every visit counted toward every rank pulled
    p_2.. down (0.13 for a true 0.3 on a Sequoia tree, where deep nodes have one child)."""
    stats = DecodeStats()
    stats.record_ranks([(0, 2), (-1, 1)])  # a 2-child node accepting its first, then a 1-child node rejecting
    stats.record_ranks([(1, 2), (0, 1)])
    assert stats.rank_visits == [4, 2] and stats.accepted_rank == [2, 1]
    assert stats.acceptance_vector() == [0.5, 0.5]  # was [0.5, 0.25]


def test_decoding_reports_each_visited_nodes_children() -> None:
    from spectot.spec.decoding import _accepted_ranks

    parents = [-1, 0, 0, 1, 3, 2]  # root: 2 children; node 1: one; node 3: one; node 2: one
    assert _accepted_ranks(parents, [0, 2, 5]) == [(1, 2), (0, 1)]
    assert _accepted_ranks(parents, [0, 1]) == [(0, 2), (-1, 1)]
