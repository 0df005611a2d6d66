"""Adaptive draft length: how many tokens a chain draft proposes this step, from the acceptance so far.

A chain of k draft tokens whose i-th token is accepted with probability alpha_i once tokens 1..i-1 were yields

    G(k) = 1 + sum_{j=1..k} prod_{i=1..j} alpha_i        tokens per step (the recovered / bonus token included)

and, when B streams share each target forward, costs

    T(k) = t(B (k + 1)) + k c                            one forward over B chains of k + 1 rows, k draft steps

in single-token target forwards (t: this machine's t(n) curve, ``spec/profile.py``, corrected as the engine
runs, below; c: one draft step).
The length taken is

    k* = argmax_{0 <= k <= K} G(k) / T(k)

Sequoia's hardware-aware rule restricted to chains. k* = 0 skips the draft (plain decoding): what a
temperature-1 thought gets from a prompt-lookup draft that cannot guess it, or a batch of many streams
where each extra row costs a full row of compute.

alpha is estimated per sampling setting (greedy evaluations and temperature-1 thoughts differ) from the
verifications so far, with a prior alpha0 of weight w:

    m_i = (a_i + w alpha0) / (r_i + w)                   a_i / r_i: accepted / reached counts at position i

and k* is taken at the optimistic alpha_i = min(1, m_i + z sqrt(m_i (1 - m_i) / (r_i + w))), an upper
confidence bound (z = 1): a position seldom tested gets the benefit of the doubt. The counts decay by gamma
at every step of that setting, skipped ones included, so the bound of a draft switched off widens again
until the draft is probed once more (never where even alpha = 1 could not pay, e.g. a compute-bound batch).

A draft whose cost does not grow with k (prompt lookup) is looked up first and cut after: its evidence class, the length n of
the n-gram it matched, keys an estimate of its own, and each stream's draft is cut to the k* of its class.
A 3-gram match copied from the prompt (an evaluator quoting the step it rates) keeps its tokens while a
1-gram guess at a sampled thought is dropped, where one estimate for both would keep or drop them together.

The draft cost c is first the offline profile's (``spec/profile.py``: a draft forward timed back to back
over a target forward at n = 1), then what the engine measures as it runs:

    c = d / u,   d: seconds per draft forward (the proposer's whole call over its forwards),
                 u: seconds per unit of t (a target step's seconds, verification included, over t(rows))

both exponential moving averages (weight ``smoothing``). The running figure sees what the profile cannot:
a draft's weights evicted from cache by each target forward, the proposer's host work (tree building,
prompt lookup), a thread's own runtime. Each observation is capped at 4x the running d, so a stream's
one-off prompt catch-up through the draft does not read as its step cost.

The offline t(n) is one stream's chain after 256 tokens; a search's forwards spread their rows over several
streams of longer contexts, each with its own keys and values to read (2-core Zen 5: the profile gives
t(4) = 1.16 and t(8) = 1.33; four streams of 512 tokens cost 1.27 at one row each and 1.58 at two). So t is
also corrected per row count n once ``min_seen`` forwards of n rows were timed:

    t(n) = t_0(n) u_n / u,       u_n: seconds per unit of t_0 over forwards of n rows (moving average)

which keeps t in the profile's units (c = d / u stays comparable) and prices a drafted step at what the
engine's own forwards of that size cost.

Lossless: each verification is exact for whatever k it is given, and k depends only on outcomes already
verified and past timings, so greedy output stays the target's and samples stay distributed as the target's.
Deterministic (top-token) drafts give the same tokens whatever k; with a sampled draft the measured cost
makes a seeded run's tokens depend on the timings (``learn_cost=False`` keeps them reproducible).

Worked example: alpha = (0.8, 0.5, 0.5), t(n) = 1 for n <= 2, then 1 + 0.25 (n - 2); c = 0, one stream:
G / T = 1, 1.8, 2.2 / 1.25 = 1.76, 2.4 / 1.5 = 1.6 for k = 0..3, so k* = 1.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from spectot.spec.sampling import SamplingParams


def chain_tokens(alpha: Sequence[float], k: int) -> float:
    """G(k) = 1 + sum_j prod_{i <= j} alpha_i: expected tokens of a verified k-token chain."""
    tokens, reach = 1.0, 1.0
    for a in alpha[:k]:
        reach *= a
        tokens += reach
    return tokens


def best_chain_length(
    alpha: Sequence[float], k_max: int, t_curve: Callable[[float], float], draft_cost: float, streams: int = 1
) -> int:
    """k* = argmax_{0 <= k <= k_max} G(k) / (t(B (k + 1)) + k c); ties go to the shorter chain."""
    best_k, best = 0, 1.0 / t_curve(streams)
    for k in range(1, min(k_max, len(alpha)) + 1):
        speed = chain_tokens(alpha, k) / (t_curve(streams * (k + 1)) + k * draft_cost)
        if speed > best * (1.0 + 1e-9):
            best_k, best = k, speed
    return best_k


@dataclass
class AcceptanceEstimate:
    """alpha_i = (a_i + w alpha0) / (r_i + w) from decayed counts, position i = 1, 2, ..."""

    prior: float  # alpha0
    weight: float  # w: pseudo-observations the prior is worth
    decay: float  # gamma per step
    accepted: list[float] = field(default_factory=list)  # a_i
    reached: list[float] = field(default_factory=list)  # r_i

    def alpha(self, k: int) -> list[float]:
        """m_1..m_k"""
        return [(a + self.weight * self.prior) / (r + self.weight) for a, r in self._counts(k)]

    def optimistic(self, k: int, z: float) -> list[float]:
        """min(1, m_i + z sqrt(m_i (1 - m_i) / (r_i + w))) for i = 1..k"""
        bounds = []
        for m, (_, r) in zip(self.alpha(k), self._counts(k)):
            bounds.append(min(1.0, m + z * math.sqrt(m * (1.0 - m) / (r + self.weight))))
        return bounds

    def _counts(self, k: int) -> list[tuple[float, float]]:
        counts = list(zip(self.accepted, self.reached))[:k]
        return counts + [(0.0, 0.0)] * (k - len(counts))

    def step(self) -> None:
        self.accepted = [a * self.decay for a in self.accepted]
        self.reached = [r * self.decay for r in self.reached]

    def observe(self, proposed: int, accepted: int) -> None:
        """One verified chain: positions 1..accepted were accepted, position accepted + 1 (if drafted) rejected."""
        reached = min(proposed, accepted + 1)
        grow = reached - len(self.reached)
        if grow > 0:
            self.accepted += [0.0] * grow
            self.reached += [0.0] * grow
        for i in range(reached):
            self.reached[i] += 1.0
            self.accepted[i] += float(i < accepted)


class DraftLength:
    """k* per step for each sampling setting's streams (and, for a free draft, each evidence class); shared
    by a decoder's sessions (and SEED's drafter and target threads, hence the lock)."""

    def __init__(
        self,
        t_curve: Callable[[float], float],
        draft_cost: float = 0.0,  # c: one draft step over one target step (0 for prompt lookup)
        priors: Mapping[float, float] | None = None,  # alpha0 by sampling temperature (greedy = 0)
        weight: float = 2.0,  # w
        decay: float = 0.98,  # gamma
        optimism: float = 1.0,  # z
        smoothing: float = 0.05,  # weight of each new cost observation in c's moving averages
        learn_cost: bool = True,  # False: keep ``draft_cost`` and t_0 whatever the engine measures
        min_seen: int = 8,  # forwards of n rows timed before t(n) uses their time
    ) -> None:
        if not draft_cost >= 0.0:
            raise ValueError(f"the draft step cost must be >= 0, got {draft_cost}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {smoothing}")
        if min_seen < 1:
            raise ValueError(f"min_seen counts forwards: it must be >= 1, got {min_seen}")
        if weight <= 0.0 or not 0.0 < decay <= 1.0 or optimism < 0.0:
            raise ValueError(f"need weight > 0, decay in (0, 1] and optimism >= 0, got {weight}, {decay}, {optimism}")
        self.priors = dict(priors) if priors else {0.0: 0.5}
        if not all(0.0 <= p <= 1.0 for p in self.priors.values()):
            raise ValueError(f"prior acceptance rates must lie in [0, 1], got {self.priors}")
        self.t_curve, self.draft_cost, self.weight, self.decay, self.optimism = (
            t_curve,
            draft_cost,
            weight,
            decay,
            optimism,
        )
        self.estimates: dict[tuple[SamplingParams, int | None], AcceptanceEstimate] = {}
        self.smoothing, self.learn_cost, self.min_seen = smoothing, learn_cost, min_seen
        self._draft_seconds: float | None = None  # d: EMA of seconds per draft forward
        self._unit_seconds: float | None = None  # u: EMA of seconds per unit of t
        self._unit_by_rows: dict[int, tuple[float, int]] = {}  # n -> (u_n, forwards of n rows timed)
        self._lock = threading.Lock()

    @property
    def cost(self) -> float:
        """c = d / u as measured so far, or the offline draft cost before both were observed."""
        if not self.learn_cost or self._draft_seconds is None or not self._unit_seconds:
            return self.draft_cost
        return self._draft_seconds / self._unit_seconds

    def observe_draft(self, seconds: float, forwards: int) -> None:
        """One proposer call of ``forwards`` draft forwards took ``seconds`` (host work included)."""
        if forwards <= 0:
            return
        with self._lock:
            per = seconds / forwards
            if self._draft_seconds is not None:  # capped: a one-off prompt catch-up is not a step's cost
                per = min(per, 4.0 * self._draft_seconds)
            self._draft_seconds = _moving_average(self._draft_seconds, per, self.smoothing)

    def observe_verify(self, seconds: float, rows: int) -> None:
        """One target forward over ``rows`` rows, verification included, took ``seconds``."""
        if rows <= 0:
            return
        with self._lock:
            unit = seconds / self.t_curve(rows)
            self._unit_seconds = _moving_average(self._unit_seconds, unit, self.smoothing)
            average, seen = self._unit_by_rows.get(rows, (None, 0))
            self._unit_by_rows[rows] = (_moving_average(average, unit, self.smoothing), seen + 1)

    def t(self, rows: float) -> float:
        """t(n) = t_0(n) u_n / u where forwards of n rows were timed ``min_seen`` times, else t_0(n)."""
        t0 = self.t_curve(rows)
        unit, seen = self._unit_by_rows.get(int(rows), (None, 0))
        if not self.learn_cost or unit is None or seen < self.min_seen or not self._unit_seconds:
            return t0
        return t0 * unit / self._unit_seconds

    def choose(self, sampling: SamplingParams, k_max: int, streams: int = 1, match: int | None = None) -> int:
        """k* for the next step of ``streams`` streams sampling with ``sampling`` (one step of that setting),
        or for one free draft of evidence class ``match``."""
        with self._lock:
            estimate = self._estimate(sampling, match)
            estimate.step()
            alpha = estimate.optimistic(k_max, self.optimism)
            return best_chain_length(alpha, k_max, self.t, self.cost, max(1, streams))

    def observe(self, sampling: SamplingParams, proposed: int, accepted: int, match: int | None = None) -> None:
        if proposed > 0:
            with self._lock:
                self._estimate(sampling, match).observe(proposed, accepted)

    def _estimate(self, sampling: SamplingParams, match: int | None) -> AcceptanceEstimate:
        if (sampling, match) not in self.estimates:
            prior = self.priors[sampling.nearest(self.priors)]
            self.estimates[(sampling, match)] = AcceptanceEstimate(prior, self.weight, self.decay)
        return self.estimates[(sampling, match)]


def _moving_average(average: float | None, value: float, weight: float) -> float:
    """The first value as it is, then average + weight (value - average)."""
    return value if average is None else average + weight * (value - average)
