"""UCT scores and selection on hand-computed tables; speculative k-path selection with virtual visits; back-up."""

from __future__ import annotations

import math

import pytest

from spectot.search.uct import (
    MctsTree,
    NodeStats,
    add_child,
    backup,
    rollout_value,
    simulate_selections,
    uct_path,
    uct_score,
    uct_select,
    weighted_backup,
)


def test_uct_score_hand_computed() -> None:
    assert uct_score(0.5, 10, 0) == math.inf
    # 0.5 + 2 sqrt(ln 10 / 4) = 0.5 + 2 * 0.758714 = 2.017427
    assert uct_score(0.5, 10, 4) == pytest.approx(2.017427, abs=1e-6)
    assert uct_score(0.7, 1, 3) == pytest.approx(0.7)  # ln 1 = 0: nothing to explore
    assert uct_score(0.2, 10, 4, c=0.0) == pytest.approx(0.2)


def test_uct_select_prefers_unvisited_then_the_first_of_ties() -> None:
    children = [NodeStats(5, 4.5), NodeStats(0, 0), NodeStats(0, 0)]
    assert uct_select(children) == 1
    assert uct_select([NodeStats(2, 1.0), NodeStats(2, 1.0)]) == 0


def test_uct_select_exploitation_against_exploration() -> None:
    # N(parent) = 20. child 0: Q = 0.9, N = 16; child 1: Q = 0.5, N = 4
    children = [NodeStats(16, 14.4), NodeStats(4, 2.0)]
    # c = 0.1: 0.9 + 0.1 sqrt(ln 20 / 16) = 0.9433  vs  0.5 + 0.1 sqrt(ln 20 / 4) = 0.5865 -> exploit child 0
    assert uct_select(children, c=0.1) == 0
    # c = 2:   0.9 + 2 * 0.4327 = 1.7655  vs  0.5 + 2 * 0.8654 = 2.2309 -> explore child 1
    assert uct_select(children, c=2.0) == 1


def test_uct_select_counts_virtual_visits() -> None:
    fresh = NodeStats(0, 0)
    speculated = NodeStats(0, 0, virtual_visits=1, virtual_value=0.0)
    assert uct_select([speculated, fresh]) == 1  # the speculated child is no longer unvisited
    assert NodeStats(2, 1.0, virtual_visits=2, virtual_value=0.0).q == pytest.approx(0.25)  # virtual loss lowers Q
    with pytest.raises(ValueError):
        uct_select([])


def test_three_speculative_descents_spread_over_three_unvisited_children() -> None:
    tree = MctsTree.make_dummy(3)
    assert simulate_selections(tree, 3) == [(0, 1), (0, 2), (0, 3)]


def test_first_descent_is_plain_uct_and_the_input_is_untouched() -> None:
    # root 0 -> 1, 2; 1 -> 3, 4. Child 1 is much better, so plain UCT goes 0 -> 1 -> (best of 3, 4)
    tree = MctsTree(
        children={0: (1, 2), 1: (3, 4)},
        visits={0: 10, 1: 8, 2: 2, 3: 5, 4: 3},
        value={0: 6.0, 1: 6.4, 2: 0.2, 3: 4.5, 4: 0.9},
    )
    before = (dict(tree.children), dict(tree.visits), dict(tree.value))
    paths = simulate_selections(tree, 4, c=1.0, virtual_value=0.0)
    assert paths[0] == uct_path(tree, c=1.0) == (0, 1, 3)
    # descent 2 (one virtual visit worth 0 on 0, 1, 3): at the root, N = 11
    #   child 1: 6.4 / 9 + sqrt(ln 11 / 9) = 1.2273  vs  child 2: 0.2 / 2 + sqrt(ln 11 / 2) = 1.1950 -> 1
    #   at node 1, N = 9: child 3: 4.5 / 6 + sqrt(ln 9 / 6) = 1.3551  vs  child 4: 0.3 + sqrt(ln 9 / 3) = 1.1558 -> 3
    # descent 3: root N = 12: child 1: 0.64 + sqrt(ln 12 / 10) = 1.1385  vs  child 2: 0.1 + sqrt(ln 12 / 2) = 1.2146
    assert paths == [(0, 1, 3), (0, 1, 3), (0, 2), (0, 1, 3)]
    assert (dict(tree.children), dict(tree.visits), dict(tree.value)) == before


def test_descent_stops_at_expandable_and_terminal_nodes() -> None:
    tree = MctsTree(children={0: (1, 2), 1: (3,)}, visits={0: 3, 1: 1, 2: 1, 3: 0}, expandable=frozenset({1}))
    assert uct_path(tree) == (0, 1)  # children tie, the first is expandable: selection stops there, not at 3
    only_expandable = MctsTree(children={0: (1,), 1: (3,)}, visits={0: 2, 1: 1}, expandable=frozenset({1}))
    assert simulate_selections(only_expandable, 2) == [(0, 1), (0, 1)]
    finished = MctsTree(children={0: (1,), 1: (3,)}, visits={0: 2, 1: 1}, terminal=frozenset({1}))
    assert uct_path(finished) == (0, 1)
    assert simulate_selections(finished, 0) == []


def test_backup_is_pure_and_adds_along_the_path() -> None:
    tree = MctsTree.make_dummy(2)
    after = backup(tree, (0, 2), 0.75)
    assert after.visits == {0: 2.0, 2: 1.0} and after.value == {0: 0.75, 2: 0.75}
    assert tree.visits == {0: 1.0} and tree.value == {}
    assert after.stats(2).q == pytest.approx(0.75)
    # the backed-up child is visited, so the next plain selection goes to the unvisited one
    assert uct_path(after) == (0, 1)


def test_add_child_grows_a_new_tree() -> None:
    tree = MctsTree(children={}, expandable=frozenset({0}))
    assert uct_path(tree) == (0,)
    grown = add_child(tree, 0, 1)
    grown = add_child(grown, 0, 2, terminal=True, parent_full=True)
    assert grown.children == {0: (1, 2)} and tree.children == {}
    assert grown.expandable == frozenset({1}) and grown.terminal == frozenset({2})
    assert simulate_selections(grown, 2) == [(0, 1), (0, 2)]
    with pytest.raises(ValueError, match="fresh id"):
        add_child(grown, 1, 2)


def test_weighted_backup_follows_the_childrens_current_values() -> None:
    """REST-MCTS*'s update, the docstring's example: a has children x (1.0) and y (0.0), one visit each; a visit
    that sets x to 0.2 weighs a's children by visits, (2 * 0.2 + 0.0) / 3, where the running mean says 0.4."""
    tree = MctsTree(children={0: (1,), 1: (2, 3)})
    tree = weighted_backup(weighted_backup(tree, (0, 1, 2), 1.0), (0, 1, 3), 0.0)
    assert tree.stats(1).q == pytest.approx(0.5) and tree.stats(0).q == pytest.approx(0.5)
    after = weighted_backup(tree, (0, 1, 2), 0.2)
    assert after.visits == {0: 3.0, 1: 3.0, 2: 2.0, 3: 1.0}
    assert after.stats(2).q == pytest.approx(0.2) and after.stats(1).q == pytest.approx(0.4 / 3)
    assert after.stats(0).q == pytest.approx(0.4 / 3)
    running = MctsTree(children=tree.children)
    for path, value in [((0, 1, 2), 1.0), ((0, 1, 3), 0.0), ((0, 1, 2), 0.2)]:
        running = backup(running, path, value)
    assert running.stats(1).q == pytest.approx(0.4)
    assert tree.stats(2).q == pytest.approx(1.0)  # the input is untouched


def test_weighted_backup_gives_unvisited_children_no_weight() -> None:
    """A REST-MCTS step's siblings join the tree unvisited: they do not dilute their parent's value."""
    tree = MctsTree(children={0: (1, 2, 3)})
    after = weighted_backup(tree, (0, 2), 0.7)
    assert after.stats(0).q == pytest.approx(0.7) and after.visits == {0: 1.0, 2: 1.0}


@pytest.mark.parametrize(
    ("rewards", "alpha", "value"),
    [([0.4], 0.5, 0.4), ([0.4, 0.9, 0.2], 0.5, 0.65), ([0.4, 0.9, 0.2], 0.0, 0.4), ([0.4, 0.1], 1.0, 0.1)],
)
def test_rollout_value_blends_the_first_reward_with_the_best_below(rewards, alpha, value) -> None:
    assert rollout_value(rewards, alpha) == pytest.approx(value)
