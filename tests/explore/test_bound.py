"""explore/bound.py: the BFS speculation ceiling replayed on a throughput curve, on hand-made trees."""

import pytest

from spectot.explore.bound import depths, per_request_rate, replay_seconds, speculation_bound
from spectot.search.expansion import Child, ChildKey
from spectot.search.tree_search import critical_path_seconds, expansion_tree, level_barrier_seconds

# the module docstring's example: depth 1 takes [3, 1] tokens, the 1-token node's child 2, the 3-token node's child 1
EXAMPLE = [(-1, 3.0), (-1, 1.0), (1, 2.0), (0, 1.0)]
FREE = per_request_rate([1, 2, 4, 8], [1.0, 2.0, 4.0, 8.0])  # r(n) = 1 token/s at any n up to 8


def test_free_concurrency_gives_the_barrier_and_the_critical_path():
    assert replay_seconds([EXAMPLE], FREE) == pytest.approx(5.0)  # max(3, 1) + max(2, 1)
    assert replay_seconds([EXAMPLE], FREE, k_total=2, lookahead=1) == pytest.approx(4.0)  # max(3 + 1, 1 + 2)
    assert speculation_bound([EXAMPLE], FREE, 1, 2, 1) == pytest.approx(1.25)


def test_k_total_caps_what_may_start_early():
    # with k_total = 1 the 2-token child may not start beside the primary 3-token node
    assert replay_seconds([EXAMPLE], FREE, k_total=1, lookahead=1) == pytest.approx(5.0)
    assert replay_seconds([EXAMPLE], FREE, k_total=2, lookahead=0) == pytest.approx(5.0)  # nothing ahead


def test_a_flat_throughput_curve_leaves_nothing_to_gain():
    flat = per_request_rate([1, 2, 4], [10.0, 10.0, 10.0])  # T(n) = 10 tokens/s whatever runs
    assert replay_seconds([EXAMPLE], flat) == pytest.approx(0.7)  # 7 tokens at 10 tokens/s
    assert speculation_bound([EXAMPLE], flat, 1, 4, 2) == pytest.approx(1.0)


def test_partial_concurrency_sits_between():
    # T(2) = 1.5 T(1): two expansions side by side each run at 0.75 tokens/s
    half = per_request_rate([1, 2], [1.0, 1.5])
    bound = speculation_bound([EXAMPLE], half, 1, 2, 1)
    assert 1.0 < bound < 1.25
    # by hand: barrier: [3, 1] together -> 1 token each at 0.75/s (1.333 s), 2 left alone (2 s): 3.333 s;
    # then [2, 1] together -> 1 token each (1.333 s), 1 left (1 s): 2.333 s. Total 5.667 s.
    assert replay_seconds([EXAMPLE], half) == pytest.approx(17 / 3)


def test_queries_in_flight_share_the_machine():
    # two one-node queries of 2 tokens: one at a time 4 s; together at T(2) = 1.5 tokens/s: 4 / 1.5 s
    half = per_request_rate([1, 2], [1.0, 1.5])
    trees = [[(-1, 2.0)], [(-1, 2.0)]]
    assert replay_seconds(trees, half, in_flight=1) == pytest.approx(4.0)
    assert replay_seconds(trees, half, in_flight=2) == pytest.approx(4 / 1.5)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="parent"):
        depths([(0, 1.0)])
    with pytest.raises(ValueError, match="in_flight"):
        replay_seconds([EXAMPLE], FREE, in_flight=0)
    with pytest.raises(ValueError, match="positive"):
        per_request_rate([1, 2], [1.0])


def test_a_search_result_exports_the_tree_it_replays():
    a = Child(ChildKey((), 0), ("a",), "a", 0.5, False, "", 3, 3.0)
    b = Child(ChildKey((), 1), ("b",), "b", 0.5, False, "", 1, 1.0)
    bc = Child(ChildKey(("b",), 0, (1,)), ("b", "c"), "c", 0.5, True, "1", 2, 2.0)
    ad = Child(ChildKey(("a",), 0, (0,)), ("a", "d"), "d", 0.5, True, "1", 1, 1.0)
    tree = expansion_tree([bc, a, ad, b])  # consumption order need not be parents first
    assert tree == [(-1, 3, 3.0), (-1, 1, 1.0), (1, 2, 2.0), (0, 1, 1.0)]  # the example, parents first
    replayed = replay_seconds([[(p, t) for p, t, _ in tree]], FREE, k_total=4, lookahead=2)
    assert replayed == pytest.approx(critical_path_seconds([a, b, bc, ad]))  # seconds = tokens here
    assert replay_seconds([[(p, t) for p, t, _ in tree]], FREE) == pytest.approx(level_barrier_seconds([a, b, bc, ad]))


def test_an_empty_tree_does_not_end_the_replay() -> None:
    """A query of no expansions admitted alone ran nothing, and the replay returned, dropping the queries after it."""
    tree = [(-1, 5.0)]
    assert replay_seconds([tree, [], tree], FREE, 1) == pytest.approx(10.0)
    assert replay_seconds([[], tree], FREE, 1) == pytest.approx(5.0)
