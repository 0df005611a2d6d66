"""The most BFS speculation can gain on this machine: a plain search's trees replayed on the engine's
measured throughput curve, once at the reward barriers and once with perfect speculation.

``critical_path_seconds`` (search/tree_search.py) bounds SPEX when concurrency is free. On a machine
whose throughput T(n) stops rising with the n requests in flight, a speculative expansion slows the
primary ones beside it, so that ceiling is out of reach. The replay here keeps the slowdown:

- the engine is processor sharing: with n expansions running, each decodes at r(n) = T(n) / n tokens/s
  (T linear between the measured points, flat past the last);
- an expansion's work is the tokens it generated (its thought and its reward), prefill left out;
- queries start in order, ``in_flight`` at a time, and end when their last expansion ends;
- barrier (plain): a node of depth d starts when every node of depth d - 1 of its query has ended;
- perfect speculation (SPEX with hit rate 1, no waste): a node whose parent has ended and whose depth is
  at most the query's level + ``lookahead`` starts early when fewer than k_total expansions run; nodes
  of the current level start at once, whatever runs (primary work never waits).

Worked example, free concurrency (r = 1 token/s at any n), one query: depth 1 takes [3, 1] tokens, the
child of the 1-token node 2, the child of the 3-token node 1. Barrier: max(3, 1) + max(2, 1) = 5 s.
Speculation with k_total >= 2: the 2-token child starts at 1 s and ends at 3 s, the other at 3 s and
ends at 4 s: 4 s, the critical path; the bound is 5 / 4 = 1.25x. With k_total = 1 the early child may
not start beside the running 3-token node: 5 s again. On a flat curve (T(n) = T) every schedule takes
the total work over T: speculation cannot gain anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

Tree = Sequence[tuple[int, float]]  # (parent index or -1 for a child of the root, work in tokens) per node


def per_request_rate(concurrency: Sequence[int], throughput: Sequence[float]) -> Callable[[int], float]:
    """r(n) = T(n) / n tokens/s for each of n requests in flight, T interpolated on the measured curve."""
    if len(concurrency) != len(throughput) or not concurrency or any(t <= 0 for t in throughput):
        raise ValueError(f"need matching, positive throughputs, got {list(concurrency)} and {list(throughput)}")
    c = np.asarray(concurrency, dtype=np.float64)
    t = np.asarray(throughput, dtype=np.float64)

    def rate(n: int) -> float:
        total = t[0] * n / c[0] if n < c[0] else float(np.interp(n, c, t))  # T(n)
        return total / n

    return rate


def depths(tree: Tree) -> list[int]:
    """Depth of each node, 1 for the root's children: parents must come before their children."""
    d: list[int] = []
    for i, (parent, _) in enumerate(tree):
        if parent >= i:
            raise ValueError(f"node {i}'s parent {parent} does not come before it")
        d.append(1 if parent < 0 else d[parent] + 1)
    return d


def replay_seconds(
    trees: Sequence[Tree], rate: Callable[[int], float], in_flight: int = 1, k_total: int = 0, lookahead: int = 0
) -> float:
    """Seconds to run ``trees`` (one per query) on a processor-sharing engine with per-request rate r(n);
    k_total = 0 or lookahead = 0: the barrier schedule, else perfect speculation (see the module)."""
    if in_flight < 1 or k_total < 0 or lookahead < 0:
        raise ValueError(f"need in_flight >= 1, k_total >= 0, lookahead >= 0: got {in_flight}, {k_total}, {lookahead}")
    depth = [depths(t) for t in trees]
    left = {(q, i): float(work) for q, tree in enumerate(trees) for i, (_, work) in enumerate(tree)}  # work left
    done: set[tuple[int, int]] = set()
    running: set[tuple[int, int]] = set()
    waiting, active = list(range(len(trees)))[::-1], []  # waiting: popped from the end, first query first
    clock = 0.0

    def level(q: int) -> float:  # the query's current level: its shallowest unfinished depth
        return min((d for i, d in enumerate(depth[q]) if (q, i) not in done), default=math.inf)

    def ready(q: int, i: int) -> bool:
        parent = trees[q][i][0]
        return (q, i) not in running and (q, i) not in done and (parent < 0 or (q, parent) in done)

    while True:
        levels = {q: level(q) for q in active}
        active = [q for q in active if levels[q] < math.inf]  # finished queries leave
        while waiting and len(active) < in_flight:
            q = waiting.pop()
            active.append(q)
            levels[q] = level(q)
        running |= {(q, i) for q in active for i, d in enumerate(depth[q]) if d == levels[q] and ready(q, i)}
        early = sorted(
            (depth[q][i], q, i)
            for q in active
            for i, d in enumerate(depth[q])
            if levels[q] < d <= levels[q] + lookahead and ready(q, i)
        )
        for _, q, i in early[: max(0, k_total - len(running))]:
            running.add((q, i))
        if not running:
            if waiting:  # the queries admitted had nothing to run (empty trees): admit the next ones
                continue
            return clock
        r = rate(len(running))
        dt = min(left[x] for x in running) / r
        clock += dt
        for x in list(running):
            left[x] -= r * dt
            if left[x] <= 1e-9:
                running.discard(x)
                done.add(x)


def speculation_bound(
    trees: Sequence[Tree], rate: Callable[[int], float], in_flight: int, k_total: int, lookahead: int
) -> float:
    """Barrier time over perfect-speculation time of the same trees on the same machine model."""
    spec = replay_seconds(trees, rate, in_flight, k_total, lookahead)
    return replay_seconds(trees, rate, in_flight) / spec if spec else 1.0
