"""SPEX's inter-query budget: how many speculative expansions each query in flight may run, and the machine-wide
total k they share (the concurrency where throughput stops rising on this machine).

Allocation. For queries q with speculative capacity C_q (expansions it could use now), speculation hit rate P_q
(the share of its past speculative expansions that the real search later chose), reusable weight S_w and KV reuse
S_KV(q) (how much of a speculative expansion's work and cache the real search can keep):

    score_q = C_q * P_q * (S_w + S_KV(q))
    k_q     = min(C_q, floor(k_total * softmax(tau * score)_q))

so sum_q k_q <= k_total and no query gets more than it can use. The floors alone can leave the budget idle
(k_total = 2 over three equal queries: floor(2/3) = 0 each), so the units they leave go, one at a time, to the
queries with room (k_q < C_q), largest remainder k_total softmax_q - k_q first (ties: the earlier query): every
unit some query can use is used, and the softmax's order decides who gets it. Worked example: k_total = 8,
C = [8, 2], P = [0.5, 0.5], S_w = 0, S_KV = [1, 1], tau = 1: score = [4, 1], softmax = [0.953, 0.047],
floor(8 * .) = [7, 0], remainders [0.62, 0.38] -> k = [8, 0]. tau >= 0 (0: an even split).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def allocate(
    k_total: int,
    capacity: Sequence[int],
    hit_rate: Sequence[float],
    reusable_weight: float | Sequence[float],
    kv_reuse: Sequence[float],
    tau: float = 1.0,
) -> list[int]:
    """k_q = min(C_q, floor(k_total softmax(tau score)_q)), score_q = C_q P_q (S_w + S_KV(q)); S_w scalar or per query."""
    n = len(capacity)
    if len(hit_rate) != n or len(kv_reuse) != n:
        raise ValueError(
            f"one value per query: got {n} capacities, {len(hit_rate)} hit rates, {len(kv_reuse)} KV reuses"
        )
    if isinstance(reusable_weight, Sequence) and len(reusable_weight) != n:
        raise ValueError(f"reusable_weight is one number or one per query: got {len(reusable_weight)} for {n} queries")
    if k_total < 0 or any(c < 0 for c in capacity):
        raise ValueError(f"k_total and capacities must be >= 0, got {k_total} and {list(capacity)}")
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be a finite number >= 0 (a negative tau favours the worst queries), got {tau}")
    if n == 0:
        return []
    if not all(math.isfinite(x) and x >= 0 for x in [*hit_rate, *kv_reuse, *np.atleast_1d(reusable_weight)]):
        raise ValueError(
            f"hit rates and reuse weights must be finite numbers >= 0, got {list(hit_rate)}, {list(kv_reuse)}"
        )
    c = np.asarray(capacity, dtype=np.float64)  # C_q
    p = np.asarray(hit_rate, dtype=np.float64)  # P_q
    s_w = np.broadcast_to(np.asarray(reusable_weight, dtype=np.float64), (n,))  # S_w
    s_kv = np.asarray(kv_reuse, dtype=np.float64)  # S_KV(q)
    score = c * p * (s_w + s_kv)  # score_q = C_q P_q (S_w + S_KV(q))
    with np.errstate(over="ignore", invalid="ignore"):  # refused just below, by name
        logits = tau * score
    if not np.isfinite(logits).all():  # tau times a large score overflowed
        raise ValueError(f"tau * score overflows (tau {tau}, scores {score.tolist()}): lower tau")
    share = np.exp(logits - logits.max())
    share /= share.sum()  # softmax(tau score)_q
    ideal = k_total * share  # k_total softmax(tau score)_q
    k = [min(int(cap), math.floor(x)) for cap, x in zip(capacity, ideal)]  # min(C_q, floor(k_total s_q))
    left = k_total - sum(k)
    while left > 0:  # the units the floors leave: largest remainder first, to queries with room
        room = sorted((q for q in range(n) if k[q] < capacity[q]), key=lambda q: (k[q] - ideal[q], q))
        if not room:
            break
        for q in room[:left]:
            k[q] += 1
        left -= min(left, len(room))
    return k


def k_total_from_curve(concurrency: Sequence[int], throughput: Sequence[float], slack: float = 0.5) -> int:
    """The most concurrent expansions that still run at nearly solo speed: the largest c_i such that every
    measured c_j <= c_i has per-request latency c_j T_1 / T_j <= 1 + slack.

    Where throughput still rises linearly (a GPU below saturation) requests cost each other nothing and
    latency stays at 1; once it stops rising, latency grows with every request. Past that point a
    speculative expansion slows the primary ones it shares forwards with, which SPEX must not do.

    Example: T = [20, 36, 62, 92, 102, 113] tokens/s at c = [1, 2, 4, 8, 16, 32]: latencies 1, 1.11,
    1.29, 1.74, ... -> k_total = 4 (slack 0.5).
    """
    if len(concurrency) != len(throughput) or not concurrency:
        raise ValueError(
            f"need matching, non-empty concurrency and throughput lists, got {len(concurrency)} and {len(throughput)}"
        )
    if any(b <= a for a, b in zip(concurrency, concurrency[1:])):
        raise ValueError(f"concurrency must be strictly increasing, got {list(concurrency)}")
    if slack < 0 or any(t <= 0 for t in throughput):
        raise ValueError(f"need slack >= 0 and positive throughputs, got {slack} and {list(throughput)}")
    solo = throughput[0] / concurrency[0]  # one request's tokens/s
    k_total = int(concurrency[0])
    for c, t in zip(concurrency, throughput):
        if c * solo / t > 1 + slack:  # latency c T_1 / T_c
            break
        k_total = int(c)
    return k_total
