"""Sequoia's dynamic program for the token tree that maximises expected generated tokens.

Positional acceptance model (Sequoia, Chen et al. 2024, section 3.1): at any node, the child of draft
rank i is the accepted one with probability p_i (ranks are exclusive; p_1 >= p_2 >= ... is typical,
sum p_i <= 1). A node v then lies on the accepted path with probability f(v) = product of p_rank over
the edges from the root, and one verification step generates F(T) = sum_v f(v) tokens in expectation
(the root term is the recovered/bonus token: acceptance length includes it).

The DP, with c(n, d) the best F over trees of n nodes and depth <= d (the root has depth 1):

    c(1, d) = 1
    c(n, d) = 1 + H_d(n - 1, 1)                     the root plus its children's subtrees
    H_d(0, j) = 0
    H_d(m, j) = max_{1 <= s <= m} p_j * c(s, d - 1) + H_d(m - s, j + 1)    children of rank j, j+1, ...

Children take ranks 1, 2, ... without gaps (a rank-j child exists only if rank j - 1 does), and the
rank-j subtree's value is scaled by p_j (p_j = 0 past the given vector: such children are leaves). G(n, d) = c(n, d) is the table the hardware-aware rule
(Sequoia section 3.3: maximise G(n, d) / (t(n) + d * c)) reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class SequoiaTree:
    parents: list[int]  # node 0 is the root, children in rank order
    expected_tokens: float  # F(T) = c(n, d), acceptance length including the bonus token
    table: list[list[float]]  # table[n][d] = c(n, d) for 1 <= n <= budget, 1 <= d <= max_depth (index 0 unused)


def expected_tokens(parents: Sequence[int], acceptance: Sequence[float]) -> float:
    """F(T) = sum over nodes of the product of p_rank along their path (the root counts 1)."""
    f = [1.0] * len(parents)
    rank_seen: dict[int, int] = {}
    for node, parent in enumerate(parents[1:], start=1):
        rank = rank_seen.get(parent, 0)
        rank_seen[parent] = rank + 1
        f[node] = f[parent] * (acceptance[rank] if rank < len(acceptance) else 0.0)
    return sum(f)


def sequoia_tree(acceptance: Sequence[float], budget: int, max_depth: int | None = None) -> SequoiaTree:
    """The tree of exactly ``budget`` nodes (root included) and depth <= max_depth maximising F(T)."""
    p = [float(x) for x in acceptance]
    if not p or any(not 0.0 <= x <= 1.0 for x in p) or sum(p) > 1.0 + 1e-6:
        raise ValueError(f"acceptance must be probabilities of exclusive ranks (each in [0, 1], sum <= 1), got {p}")
    if budget < 1:
        raise ValueError(f"the tree budget must be >= 1 node, got {budget}")
    depth = budget if max_depth is None else max_depth
    if depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if budget > 1 and depth == 1:
        raise ValueError(f"a tree of {budget} nodes needs depth >= 2 (depth 1 holds only the root)")
    k = len(p)

    @cache
    def c(n: int, d: int) -> tuple[float, tuple]:
        """(best value, children plan) for a subtree of n nodes and depth <= d; plan = sizes by rank."""
        if n == 1:
            return 1.0, ()
        if d <= 1:
            return -math.inf, ()
        value, plan = h(n - 1, 1, d)
        return 1.0 + value, plan

    @cache
    def h(m: int, j: int, d: int) -> tuple[float, tuple]:
        """Best value of m nodes spread over children of ranks j, j+1, ... (subtree depth <= d - 1)."""
        if m == 0:
            return 0.0, ()
        if j > k:  # ranks past the acceptance vector are never accepted: zero-value leaves, still a tree
            return 0.0, (1,) * m
        best, best_plan = -math.inf, ()
        for s in range(1, m + 1):
            sub, _ = c(s, d - 1)
            rest, rest_plan = h(m - s, j + 1, d)
            value = p[j - 1] * sub + rest
            if value > best:
                best, best_plan = value, (s, *rest_plan)
        return best, best_plan

    value, _ = c(budget, depth)
    if value == -math.inf:
        raise ValueError(f"no tree of {budget} nodes fits depth {depth}: raise max_depth")
    parents = [-1]
    _build(c, parents, 0, budget, depth)
    table = [[0.0] * (depth + 1)] + [[0.0] + [c(n, d)[0] for d in range(1, depth + 1)] for n in range(1, budget + 1)]
    return SequoiaTree(parents, value, table)


def _build(c, parents: list[int], node: int, n: int, d: int) -> None:
    """Append the optimal subtree's children under ``node`` (breadth by rank, then recurse)."""
    _, plan = c(n, d)
    children = []
    for _size in plan:
        parents.append(node)
        children.append(len(parents) - 1)
    for child, size in zip(children, plan):
        _build(c, parents, child, size, d - 1)
