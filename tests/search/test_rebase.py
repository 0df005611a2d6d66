"""REBASE's width rule and weighted vote on hand-made rewards and answers."""

from __future__ import annotations

import pytest

from spectot.search.rebase import AnswerGroup, best_answer, rebase_widths, weighted_vote


@pytest.mark.parametrize(
    "rewards, budget",
    [([0.1, 0.7, 0.3], 7), ([0.9, 0.2, 0.5, 0.5, 0.8], 64), ([5.0], 3), ([0.3, 0.31, 0.29, 0.33], 10)],
)
def test_widths_sum_to_budget_and_are_non_negative(rewards: list[float], budget: int) -> None:
    widths = rebase_widths(rewards, budget)
    assert sum(widths) == budget
    assert all(w >= 0 for w in widths)


def test_equal_rewards_balance_and_leftovers_go_to_earlier_nodes() -> None:
    assert rebase_widths([0.5, 0.5, 0.5, 0.5], 8) == [2, 2, 2, 2]
    assert rebase_widths([0.5, 0.5, 0.5], 4) == [2, 1, 1]  # quotas 4/3 each: the one leftover goes to node 0
    assert rebase_widths([0.5, 0.5, 0.5], 5) == [2, 2, 1]


def test_dominant_reward_takes_the_whole_budget_at_t_0_2() -> None:
    assert rebase_widths([0.1, 0.9, 0.05], 8, temperature=0.2) == [0, 8, 0]


def test_hand_computed_largest_remainder() -> None:
    # softmax([1, .95, .2] / 0.2) = [.5565, .4334, .0102]; quotas x8 = [4.452, 3.467, 0.081]
    # floors [4, 3, 0] leave one child; the largest remainder is node 1's (.467) -> [4, 4, 0]
    assert rebase_widths([1.0, 0.95, 0.2], 8) == [4, 4, 0]
    # a high temperature flattens: quotas x8 = [3.33, 3.17, 1.50] -> floors [3, 3, 1] + node 2 (.50) -> [3, 3, 2]
    assert rebase_widths([1.0, 0.95, 0.2], 8, temperature=1.0) == [3, 3, 2]


def test_edge_cases_and_errors() -> None:
    assert rebase_widths([], 8) == []
    assert rebase_widths([0.2, 0.9], 0) == [0, 0]
    assert rebase_widths([1e6, -1e6], 3) == [3, 0]  # no overflow
    with pytest.raises(ValueError, match="budget"):
        rebase_widths([0.5], -1)
    with pytest.raises(ValueError, match="temperature"):
        rebase_widths([0.5], 2, temperature=0.0)
    with pytest.raises(ValueError, match="temperature T_b must be a number > 0, got nan"):  # widths of -2^63 before
        rebase_widths([0.5, 0.5], 4, temperature=float("nan"))
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):  # a slice error before
        rebase_widths([0.5, 0.5], 2.7)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", float("nan"), "temperature must be a number > 0"),
        ("c", float("nan"), "UCT constant c must be a number >= 0"),
        ("c", -1.0, "UCT constant c must be a number >= 0"),
        ("lambda_kv", -1.0, "lambda_kv and lambda_cov must be numbers >= 0"),
        ("lambda_cov", float("inf"), "lambda_kv and lambda_cov must be numbers >= 0"),
    ],
)
def test_a_search_config_refuses_what_no_search_can_use(field: str, value: float, message: str) -> None:
    """The CLI checked these; the library took NaN for a temperature (NaN <= 0 is False)."""
    from spectot.search.tree_search import TreeSearchConfig

    with pytest.raises(ValueError, match=message):
        TreeSearchConfig(**{field: value})


def test_weighted_vote_groups_sums_and_sorts() -> None:
    groups = weighted_vote(["4", "5", None, "4", "5", "6"], [0.2, 0.5, 0.9, 0.3, 0.4, 0.9])
    assert groups == [AnswerGroup("5", 0.9, 2), AnswerGroup("6", 0.9, 1), AnswerGroup("4", 0.5, 2)]
    assert groups[2].mean_weight == pytest.approx(0.25)
    assert best_answer(groups) == "5"  # ties on weight keep the first-seen group first


def test_weighted_vote_uses_the_equivalence() -> None:
    def same_number(a: str, b: str) -> bool:
        return float(a) == float(b)

    groups = weighted_vote(["0.5", "1/2", "0.50", "2"], [1.0, 1.0, 1.0, 2.5], same=lambda a, b: a == b)
    assert [g.answer for g in groups] == ["2", "0.5", "1/2", "0.50"]
    groups = weighted_vote(["0.5", "2", "0.50"], [1.0, 1.5, 1.0], same=same_number)
    assert groups == [AnswerGroup("0.5", 2.0, 2), AnswerGroup("2", 1.5, 1)]


def test_tied_groups_keep_the_first_seen_whatever_the_rounding() -> None:
    """B's 0.1 + 0.2 summed to 0.30000000000000004 and beat A's 0.3; rewards of k / 9 tied the same way."""
    for weights in ([0.3, 0.1, 0.2], [6 / 9, 1 / 9, 5 / 9]):
        groups = weighted_vote(["A", "B", "B"], weights)
        assert [g.answer for g in groups] == ["A", "B"] and best_answer(groups) == "A"
        assert best_answer(list(reversed(groups))) == "B"  # first seen in the order given
    assert best_answer(weighted_vote(["A", "B", "B"], [0.3, 0.1, 0.2001])) == "B"  # a real difference still wins


def test_weighted_vote_with_nothing_answered() -> None:
    assert weighted_vote([None, None], [1.0, 1.0]) == []
    assert best_answer([]) is None
    with pytest.raises(ValueError, match="one weight per answer"):
        weighted_vote(["1"], [])
