"""The Sequoia DP: optimal against brute force over every tree up to 7 nodes, its value is the
expected acceptance length under the positional acceptance model (checked by simulation)."""

from __future__ import annotations

import math
import random
from functools import cache

import pytest

from spectot.spec.trees.sequoia import expected_tokens, sequoia_tree

ACCEPTANCE = [0.55, 0.2, 0.1, 0.05]


@cache
def plane_trees(n: int) -> tuple[tuple, ...]:
    """Every ordered tree of n nodes, as nested tuples of children."""
    if n == 1:
        return ((),)
    return tuple(forest for forest in forests(n - 1))


@cache
def forests(m: int) -> tuple[tuple, ...]:
    """Every ordered sequence of trees with m nodes in total."""
    if m == 0:
        return ((),)
    out = []
    for first in range(1, m + 1):
        for head in plane_trees(first):
            for tail in forests(m - first):
                out.append((head, *tail))
    return tuple(out)


def to_parents(tree: tuple) -> list[int]:
    parents = [-1]

    def add(node: int, children: tuple) -> None:
        ids = []
        for _ in children:
            parents.append(node)
            ids.append(len(parents) - 1)
        for child, grand in zip(ids, children):
            add(child, grand)

    add(0, tree)
    return parents


def depth(parents: list[int]) -> int:
    d = [1] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        d[i] = d[p] + 1
    return max(d)


def test_catalan_counts() -> None:
    assert [len(plane_trees(n)) for n in range(1, 8)] == [1, 1, 2, 5, 14, 42, 132]


@pytest.mark.parametrize("max_depth", [2, 3, None])
@pytest.mark.parametrize("acceptance", [ACCEPTANCE, [0.9], [0.3, 0.3, 0.3], [0.7, 0.1]])
def test_dp_equals_brute_force_up_to_seven_nodes(acceptance: list[float], max_depth: int | None) -> None:
    for n in range(2, 8):
        best = max(
            (
                expected_tokens(to_parents(t), acceptance)
                for t in plane_trees(n)
                if max_depth is None or depth(to_parents(t)) <= max_depth
            ),
            default=-math.inf,
        )
        dp = sequoia_tree(acceptance, n, max_depth)
        assert dp.expected_tokens == pytest.approx(best)
        assert len(dp.parents) == n
        assert expected_tokens(dp.parents, acceptance) == pytest.approx(dp.expected_tokens)
        if max_depth is not None:
            assert depth(dp.parents) <= max_depth


def test_table_is_monotone_in_depth_and_matches_trees() -> None:
    result = sequoia_tree(ACCEPTANCE, 12, 5)
    for n in range(1, 13):
        row = result.table[n][1:]
        finite = [v for v in row if v > -math.inf]
        assert finite == sorted(finite)
    assert result.table[12][5] == pytest.approx(result.expected_tokens)
    assert result.table[5][4] == pytest.approx(sequoia_tree(ACCEPTANCE, 5, 4).expected_tokens)


def test_prediction_matches_simulation_of_the_positional_model() -> None:
    result = sequoia_tree(ACCEPTANCE, 16, 6)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(result.parents[1:], start=1):
        children.setdefault(parent, []).append(node)
    rng = random.Random(0)
    trials, total = 40_000, 0
    for _ in range(trials):
        node, length = 0, 1
        while True:
            u, rank = rng.random(), None
            for i, p in enumerate(ACCEPTANCE):  # the accepted rank, exclusive events
                if u < p:
                    rank = i
                    break
                u -= p
            kids = children.get(node, [])
            if rank is None or rank >= len(kids):
                break
            node, length = kids[rank], length + 1
        total += length
    mean = total / trials
    assert mean == pytest.approx(result.expected_tokens, rel=0.02)


def test_more_budget_never_hurts_and_beats_a_chain() -> None:
    values = [sequoia_tree(ACCEPTANCE, n, 8).expected_tokens for n in range(1, 20)]
    assert values == sorted(values)
    assert values[-1] > expected_tokens([-1] + list(range(18)), ACCEPTANCE)  # chain of 19 nodes


@pytest.mark.parametrize(
    ("acceptance", "budget", "max_depth"),
    [([], 4, None), ([0.7, 0.5], 4, None), ([-0.1], 4, None), ([0.5], 0, None), ([0.5], 3, 1), ([0.5], 2, 0)],
)
def test_impossible_requests_are_refused(acceptance, budget, max_depth) -> None:
    with pytest.raises(ValueError):
        sequoia_tree(acceptance, budget, max_depth)


def test_large_budgets_at_any_depth() -> None:
    """The DP runs bottom-up: 256 nodes with no depth limit raised RecursionError, 768 at depth 12 took 23 s."""
    tree = sequoia_tree([0.6, 0.2, 0.1], 256)
    assert len(tree.parents) == 256 and tree.expected_tokens == pytest.approx(
        expected_tokens(tree.parents, [0.6, 0.2, 0.1])
    )
    assert tree.expected_tokens > sequoia_tree([0.6, 0.2, 0.1], 128).expected_tokens
    wide = sequoia_tree([0.6, 0.2, 0.1], 768, 12)
    assert len(wide.parents) == 768 and wide.expected_tokens == pytest.approx(5.7886, abs=1e-4)


def test_a_deep_tree_is_built_without_recursion() -> None:
    """The DP ran bottom-up but the build recursed once per level: a chain deeper than Python's recursion limit
    (sequoia_tree([0.99], 1024), allowed by --tree-budget) raised RecursionError. Here under a lowered limit."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(120)
    try:
        tree = sequoia_tree([0.99], 200)
    finally:
        sys.setrecursionlimit(limit)
    assert tree.parents == [-1] + list(range(199))  # one candidate a depth: a chain
