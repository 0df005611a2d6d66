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

import numpy as np


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
    c, choice = _table(p, budget, depth)
    value = float(c[depth, budget])
    if value == -math.inf:
        raise ValueError(f"no tree of {budget} nodes fits depth {depth}: raise max_depth")
    parents = [-1]
    _build(choice, len(p), parents, 0, budget, depth)
    table = [[0.0] * (depth + 1)] + [
        [0.0] + [float(c[d, n]) for d in range(1, depth + 1)] for n in range(1, budget + 1)
    ]
    return SequoiaTree(parents, value, table)


def _table(p: list[float], budget: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The DP bottom-up, depth by depth and rank by rank (no recursion: budgets of hundreds of nodes at any
    depth): c[d, n] = c(n, d) (-inf where no tree fits), and choice[d, j, m] = the size s of the rank-j
    subtree that H_d(m, j) picks (the smallest on ties)."""
    k = len(p)
    c = np.full((depth + 1, budget + 1), -np.inf)
    c[1:, 1] = 1.0  # c(1, d) = 1
    choice = np.zeros((depth + 1, k + 1, budget), dtype=np.int32)
    m = np.arange(budget)[:, None]  # H's m: 0 .. budget - 1 (the nodes under a root)
    s = np.arange(1, budget)[None, :]  # the rank-j subtree's size
    fits = s <= m
    for d in range(2, depth + 1):
        sub = c[d - 1, 1:budget][None, :]  # c(s, d - 1)
        feasible = fits & np.isfinite(sub)
        h = np.zeros(budget)  # H_d(m, k + 1) = 0: ranks past the vector are never accepted (zero-value leaves)
        for j in range(k, 0, -1):
            value = np.where(feasible, p[j - 1] * np.where(feasible, sub, 0.0) + h[np.maximum(m - s, 0)], -np.inf)
            best = value.argmax(axis=1) if budget > 1 else np.zeros(budget, dtype=np.int64)
            h_j = value[np.arange(budget), best] if budget > 1 else np.zeros(budget)
            h_j[0] = 0.0  # H_d(0, j) = 0
            choice[d, j] = best + 1
            h = h_j
        c[d, 2:] = 1.0 + h[1:]  # c(n, d) = 1 + H_d(n - 1, 1)
    return c, choice


def _build(choice: np.ndarray, k: int, parents: list[int], node: int, n: int, d: int) -> None:
    """Append the optimal subtree's children under ``node``: a node's children by rank, then each child's subtree
    in turn (depth first, by an explicit stack: a chain of a thousand nodes is a thousand levels)."""
    stack = [(node, n, d)]
    while stack:
        node, n, d = stack.pop()
        plan, m, j = [], n - 1, 1
        while m > 0:
            size = int(choice[d, j, m]) if j <= k else 1  # past the vector: leaves
            plan.append(size)
            m, j = m - size, j + 1
        first = len(parents)
        parents.extend([node] * len(plan))
        stack.extend((first + i, size, d - 1) for i, size in reversed(list(enumerate(plan))))
