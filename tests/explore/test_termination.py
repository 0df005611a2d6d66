"""SPEX's early termination on hand-made vote tables: n >= t and conf_1st - conf_2nd > alpha avg(w_2nd)."""

from __future__ import annotations

import pytest

from spectot.explore.termination import settled
from spectot.search.rebase import AnswerGroup, weighted_vote


def test_clear_winner_settles() -> None:
    groups = [AnswerGroup("5", 2.4, 3), AnswerGroup("6", 0.9, 2)]
    assert settled(groups, n_answers=5, t=4)  # 1.5 > 0.5 * 0.45


def test_too_few_answers_never_settle() -> None:
    groups = [AnswerGroup("5", 2.4, 3), AnswerGroup("6", 0.9, 2)]
    assert not settled(groups, n_answers=5, t=6)
    assert not settled([AnswerGroup("5", 3.0, 3)], n_answers=3, t=4)


def test_close_race_does_not_settle() -> None:
    # gap 0.3; avg(w_2nd) = 1.6 / 2 = 0.8: 0.3 > 0.5 * 0.8 fails, 0.3 > 0.25 * 0.8 holds
    groups = [AnswerGroup("5", 1.9, 3), AnswerGroup("6", 1.6, 2)]
    assert not settled(groups, n_answers=5, t=4)
    assert settled(groups, n_answers=5, t=4, alpha=0.25)


def test_gap_equal_to_the_bound_is_not_enough() -> None:
    groups = [AnswerGroup("a", 1.5, 2), AnswerGroup("b", 1.0, 1)]  # gap 0.5 == 0.5 * 1.0: strict inequality
    assert not settled(groups, n_answers=3, t=3)


def test_single_group_settles_once_there_are_enough_answers() -> None:
    assert settled([AnswerGroup("7", 0.4, 4)], n_answers=4, t=4)
    assert not settled([], n_answers=4, t=0)


def test_unsorted_groups_and_the_vote_pipeline() -> None:
    groups = weighted_vote(["3", "4", "3", "3", None], [0.9, 0.8, 0.7, 0.8, 1.0])
    assert settled(list(reversed(groups)), n_answers=4, t=4)  # 2.4 - 0.8 > 0.5 * 0.8


def test_an_alpha_that_is_no_margin_is_refused() -> None:
    """NaN never settled a vote, in silence; a negative alpha settled ties (the CLI checked, the library did not)."""
    from spectot.explore.queries import ExploreConfig

    for alpha in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
            ExploreConfig(alpha=alpha)
