"""Adaptive draft length: how many tokens a chain draft proposes this step, from the acceptance so far.

A chain of k draft tokens whose i-th token is accepted with probability alpha_i once tokens 1..i-1 were yields

    G(k) = 1 + sum_{j=1..k} prod_{i=1..j} alpha_i        tokens per step (the recovered / bonus token included)

and, when B streams share each target forward, costs

    T(k) = t(B (k + 1)) + k c                            one forward over B chains of k + 1 rows, k draft steps

in single-token target forwards (t: this machine's t(n) curve, ``spec/profile.py``; c: one draft step), or in
seconds where the engine's own forwards price it (below). The length taken is

    k* = argmax_{0 <= k <= K} G(k) / T(k)

Sequoia's hardware-aware rule restricted to chains. k* = 0 skips the draft (plain decoding): what a
temperature-1 thought gets from a prompt-lookup draft that cannot guess it, or a batch of many streams
where each extra row costs a full row of compute.

alpha is estimated per sampling setting (greedy evaluations and temperature-1 thoughts differ) from the
verifications so far, with a prior alpha0 of weight w:

    m_i = (a_i + w alpha0) / (r_i + w)                   a_i / r_i: accepted / reached counts at position i

and k* is taken at the optimistic alpha_i = min(1, m_i + z sqrt(m_i (1 - m_i) / (r_i + w_t))), an upper
confidence bound (z = 1): a position seldom tested gets the benefit of the doubt. The counts decay by gamma at
every step of that setting, skipped ones included, and while nothing is observed so does the prior's weight in
the bound's width (w_t = w gamma^t, t the steps since the last observation; the mean keeps w): the bound of a
draft switched off widens again until the draft is probed once more, whatever its prior (never where even
alpha = 1 could not pay, e.g. a compute-bound batch), so a prior far below the true rate cannot switch a draft
off for good, and a draft that runs every step is bounded as with a fixed w.

A draft decoder (EDD, VDM) can also verify its first token's runners-up (``max_width`` > 1): the tree of
w candidates at depth 1 with the chain below the first (``shapes.fan_chain_tree``) yields

    G(k, w) = G(k) + sum_{r=2..w} P_r                    P_r: chance the target's token is the draft's rank r
    T(k, w) = t(B (k + w)) + k c                          the w candidates come from the same draft forward

and (k*, w*) = argmax G(k, w) / T(k, w). Where only m of the B streams draft this way (a step mixing
greedy evaluations with temperature-1 thoughts: each sampling setting is decided on its own), the others
keep one row and one token each:

    (k*, w*) = argmax (B - m + m G(k, w)) / (t(B + e + m (k + w - 1)) + k c(m))   against B / t(B + e)

(e: the rows of the groups decided before it in this step), so a group is neither charged for rows its
neighbours do not draft nor credited with their tokens; the groups are decided one after another, each
over the rows already taken (a greedy rule, not a joint optimum). P_r (the rank-r terms of Sequoia's acceptance vector) is estimated
as alpha is, each verified fan counting one trial per runner-up, its prior the draft's shipped vector; it
enters at its mean (upper bounds on w - 1 runners-up would add up and favour wide fans). Where the draft's
first guess lands a quarter of the time (temperature-1 thoughts) its runners-up add tokens: one stream of
GSM8K answers at T = 1 took 1.29 tokens a step with k = 1 and 1.40 / 1.48 / 1.53 with 2 / 3 / 4 candidates.
Whether that pays depends on what a row costs: on a 2-core Zen 5 each costs 7-9 % of a forward after a few
hundred tokens and fans broke even at best (``scripts/adaptive_width.sh``), so the pipeline allows fans only
where its load-time t(n) shows rows nearly free (``pipeline.fan_width``, the default ``--draft-width 0``).

A draft whose cost does not grow with k (prompt lookup) is looked up first and cut after: its evidence class,
the length n of the n-gram it matched, keys an estimate of its own, and each stream's draft is cut to the k* of
its class. A 3-gram match copied from the prompt (an evaluator quoting the step it rates) keeps its tokens
while a 1-gram guess at a sampled thought is dropped, where one estimate for both would keep or drop them
together.

The draft cost c is first the offline profile's (``spec/profile.py``: a draft forward timed back to back
over a target forward at n = 1), then what the engine measures as it runs:

    c = d / u,   d: seconds per draft forward (the proposer's whole call over its forwards),
                 u: seconds per unit of t (a target step's seconds, verification included, over t(rows))

both exponential moving averages (weight ``smoothing``). The running figure sees what the profile cannot:
a draft's weights evicted from cache by each target forward, the proposer's host work (tree building,
prompt lookup), a thread's own runtime. Each observation is capped at 4x the running d (of its stream
count, or the nearest count's for a count's first), so a stream's one-off prompt catch-up through the draft
does not read as its step cost.

The offline t(n) is one stream's chain after 256 tokens. A search's forwards spread their rows over several
streams of 400-700 tokens, each with its own keys and values to read, where a row costs more than the
profile says (2-core Zen 5: the profile gives t(4) = 1.16 and t(8) = 1.33; four streams of 512 tokens cost
1.27 t(1) at one row each and 1.58 at two; in a REBASE run one stream of ~650 tokens took 11.3 ms at one row
and 15.3 ms at five). Given a ``ForwardTime`` and the live streams' context, T is priced in seconds by what
the engine's own forwards cost:

    s(n, K, R) = b_0 + b_1 n + b_2 K + b_3 R     n rows, K context tokens of the streams, R = sum_s rows_s x ctx_s
    T(k, w) = s(B (k + w), K, (k + w) K) + k d

(weights streamed once, per-row compute, each stream's keys and values read, attention work), fit by
exponentially weighted least squares over the forwards so far, around the offline profile's points as
fixed pseudo-forwards (so a shape never run, e.g. rows beyond the streams, is priced by the profile's slope).
A table per row count was tried first: it read one long evaluation stream's one-row forwards against four
short thoughts' four-row ones and found rows cheaper than they are. (A free draft's classes, ``choose``,
keep t and c.)

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

import numpy as np

from spectot.spec.sampling import SamplingParams


def chain_tokens(alpha: Sequence[float], k: int) -> float:
    """G(k) = 1 + sum_j prod_{i <= j} alpha_i: expected tokens of a verified k-token chain."""
    tokens, reach = 1.0, 1.0
    for a in alpha[:k]:
        reach *= a
        tokens += reach
    return tokens


def best_chain_length(
    alpha: Sequence[float],
    k_max: int,
    t_curve: Callable[[float], float],
    draft_cost: float,
    streams: int = 1,
    members: int | None = None,
) -> int:
    """k* = argmax_{0 <= k <= k_max} G(k) / (t(B (k + 1)) + k c); ties go to the shorter chain (``members``:
    as in ``best_fan_chain``)."""
    return best_fan_chain(alpha, (), k_max, 1, t_curve, draft_cost, streams, members)[0]


def best_fan_chain(
    alpha: Sequence[float],
    runners_up: Sequence[float],  # P_2, P_3, ...
    k_max: int,
    w_max: int,
    t_curve: Callable[[float], float],
    draft_cost: float,
    streams: int = 1,  # B: streams in the forward
    members: int | None = None,  # m <= B of them drafted this way (None: all); the rest decode one token each
    extra_rows: int = 0,  # e: rows other groups' drafts already add to the forward
) -> tuple[int, int]:
    """(k*, w*) = argmax (B - m + m G(k, w)) / (t(B + e + m (k + w - 1)) + k c) over 1 <= k <= k_max,
    1 <= w <= w_max, against plain decoding's B / t(B + e) ((0, 1): no draft); ties go to the shorter chain,
    then the narrower fan. With m = B, e = 0: G(k, w) / (t(B (k + w)) + k c). The other streams count one
    token each (their own drafts' tokens are theirs to weigh)."""
    m = streams if members is None else members
    if not 1 <= m <= streams or extra_rows < 0:
        raise ValueError(
            f"the drafted streams must be between 1 and the {streams} in the forward and the extra rows >= 0, "
            f"got {m} and {extra_rows}"
        )
    base = streams + extra_rows
    best_shape, best = (0, 1), streams / t_curve(base)
    for k in range(1, min(k_max, len(alpha)) + 1):
        for w in range(1, min(w_max, len(runners_up) + 1) + 1):
            tokens = streams - m + m * (chain_tokens(alpha, k) + sum(runners_up[: w - 1]))
            speed = tokens / (t_curve(base + m * (k + w - 1)) + k * draft_cost)
            if speed > best * (1.0 + 1e-9):
                best_shape, best = (k, w), speed
    return best_shape


@dataclass
class AcceptanceEstimate:
    """alpha_i = (a_i + w alpha0) / (r_i + w) from decayed counts, position i = 1, 2, ..."""

    prior: float | tuple[float, ...]  # alpha0, or one per position (the last one for the positions past them)
    weight: float  # w: pseudo-observations the prior is worth at the start
    decay: float  # gamma per step
    accepted: list[float] = field(default_factory=list)  # a_i
    reached: list[float] = field(default_factory=list)  # r_i
    steps: int = 0  # steps since the last observation: the prior's weight in the bound is w gamma^steps

    @property
    def prior_weight(self) -> float:
        """w_t = w gamma^steps (floored at w / 1000): what the prior is worth in the bound's width."""
        return self.weight * max(self.decay**self.steps, 1e-3)

    def alpha(self, k: int) -> list[float]:
        """m_1..m_k"""
        priors = self.prior if isinstance(self.prior, tuple) else (self.prior,)
        return [
            (a + self.weight * priors[min(i, len(priors) - 1)]) / (r + self.weight)
            for i, (a, r) in enumerate(self._counts(k))
        ]

    def optimistic(self, k: int, z: float) -> list[float]:
        """min(1, m_i + z sqrt(m_i (1 - m_i) / (r_i + w_t))) for i = 1..k"""
        bounds = []
        w = self.prior_weight
        for m, (_, r) in zip(self.alpha(k), self._counts(k)):
            bounds.append(min(1.0, m + z * math.sqrt(m * (1.0 - m) / (r + w))))
        return bounds

    def _counts(self, k: int) -> list[tuple[float, float]]:
        counts = list(zip(self.accepted, self.reached))[:k]
        return counts + [(0.0, 0.0)] * (k - len(counts))

    def step(self) -> None:
        self.accepted = [a * self.decay for a in self.accepted]
        self.reached = [r * self.decay for r in self.reached]
        self.steps += 1

    def observe(self, proposed: int, accepted: int) -> None:
        """One verified chain: positions 1..accepted were accepted, position accepted + 1 (if drafted) rejected."""
        reached = min(proposed, accepted + 1)
        self._count(reached, range(accepted))

    def observe_alternatives(self, tried: int, accepted: int | None) -> None:
        """One verification of ``tried`` mutually exclusive candidates (positions 1..tried all tested), of which
        the one at index ``accepted`` (0-based) was accepted, or none."""
        self._count(tried, () if accepted is None else (accepted,))

    def _count(self, reached: int, accepted: Sequence[int]) -> None:
        """Positions 1..reached tested, those at the indices ``accepted`` accepted."""
        self.steps = 0
        grow = reached - len(self.reached)
        if grow > 0:
            self.accepted += [0.0] * grow
            self.reached += [0.0] * grow
        for i in range(reached):
            self.reached[i] += 1.0
        for i in accepted:
            self.accepted[i] += 1.0


MIN_PRIOR = 1e-3  # the least prior acceptance: at 0 the optimistic bound is 0, so k* = 0, nothing is ever observed
#                   and the prior never moves (a measured acceptance of 0, from a measurement of no visits, did that)


class DraftLength:
    """k* (and w*) per step for each sampling setting's streams (and, for a free draft, each evidence class);
    shared by a decoder's sessions (and SEED's drafter and target threads, hence the lock)."""

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
        forward_time: ForwardTime | None = None,  # prices T in seconds when a step's context is given
        max_width: int = 1,  # w: candidates for the first token a draft decoder may verify (1: chains only)
        runner_up_priors: Mapping[float, Sequence[float]] | None = None,  # P_2, P_3, ... by temperature
    ) -> None:
        if not draft_cost >= 0.0:
            raise ValueError(f"the draft step cost must be >= 0, got {draft_cost}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {smoothing}")
        if max_width < 1:
            raise ValueError(f"max_width counts candidates: it must be >= 1, got {max_width}")
        if weight <= 0.0 or not 0.0 < decay <= 1.0 or optimism < 0.0:
            raise ValueError(f"need weight > 0, decay in (0, 1] and optimism >= 0, got {weight}, {decay}, {optimism}")
        given = dict(priors) if priors else {0.0: 0.5}
        if not all(0.0 <= p <= 1.0 for p in given.values()):
            raise ValueError(f"prior acceptance rates must lie in [0, 1], got {given}")
        self.priors = {t: max(p, MIN_PRIOR) for t, p in given.items()}
        self.t_curve, self.draft_cost, self.weight, self.decay, self.optimism = (
            t_curve,
            draft_cost,
            weight,
            decay,
            optimism,
        )
        self.estimates: dict[tuple[SamplingParams, int | None], AcceptanceEstimate] = {}
        self.max_width = max_width
        ranks = {t: tuple(v) for t, v in (runner_up_priors or {0.0: [0.05]}).items() if len(v)}
        if not ranks or not all(0.0 <= p <= 1.0 for v in ranks.values() for p in v):
            raise ValueError(f"runner-up acceptance priors must be probabilities, got {runner_up_priors}")
        # ranks past a measured vector: MIN_PRIOR, as Sequoia's DP reads them (0), not the last rank's again; the
        # default guess (no vector measured) stands for every rank (ranks priced near 0 are never drafted, so
        # never observed: a draft without acceptance.json could never fan past 2)
        pad = runner_up_priors is not None
        self.runner_up_priors = {
            t: tuple(max(p, MIN_PRIOR) for p in v) + (MIN_PRIOR,) * (max_width - 1 - len(v) if pad else 0)
            for t, v in ranks.items()
        }
        self.runners_up: dict[SamplingParams, AcceptanceEstimate] = {}  # P_r, r = 2.. (position i: rank i + 1)
        self.smoothing, self.learn_cost, self.forward_time = smoothing, learn_cost, forward_time
        # d(B): EMA of seconds per draft forward of a step with B streams (each stream adds its catch-up rows
        # and its host work, so one d for all would price a search's several streams at a lone stream's cost)
        self._draft_seconds: dict[int, float] = {}
        self._unit_seconds: float | None = None  # u: EMA of seconds per unit of t
        self._lock = threading.Lock()

    @property
    def cost(self) -> float:
        """c = d(1) / u as measured so far, or the offline draft cost before both were observed."""
        return self.cost_for(1)

    def cost_for(self, streams: int) -> float:
        """c(B) = d(B) / u: a draft forward for B streams over a unit of t."""
        d = self.draft_seconds(streams)
        if not self.learn_cost or d is None or not self._unit_seconds:
            return self.draft_cost
        return d / self._unit_seconds

    def draft_seconds(self, streams: int) -> float | None:
        """d(B), or d of the nearest stream count measured (the larger on a tie); None before any."""
        if not self._draft_seconds:
            return None
        nearest = min(self._draft_seconds, key=lambda b: (abs(b - streams), -b))
        return self._draft_seconds[nearest]

    def observe_draft(self, seconds: float, forwards: int, streams: int = 1) -> None:
        """One proposer call of ``forwards`` draft forwards for ``streams`` drafted streams took ``seconds``
        (host work included)."""
        if forwards <= 0:
            return
        with self._lock:
            per = seconds / forwards
            known = self._draft_seconds.get(streams)
            reference = known if known is not None else self.draft_seconds(streams)  # else the nearest count's
            if reference is not None:  # capped: a one-off prompt catch-up is not a step's cost (a count seen
                per = min(per, 4.0 * reference)  # first with one would price drafting off there for good)
            self._draft_seconds[streams] = _moving_average(known, per, self.smoothing)

    def observe_verify(self, seconds: float, rows: int, context: int | None = None, work: int | None = None) -> None:
        """One target forward over ``rows`` rows took ``seconds``, verification included; ``context``: its
        streams' context tokens, ``work``: sum over streams of rows x context (for the ``ForwardTime``)."""
        if rows <= 0:
            return
        with self._lock:
            self._unit_seconds = _moving_average(self._unit_seconds, seconds / self.t_curve(rows), self.smoothing)
            if self.forward_time is not None and self.learn_cost and context is not None and work is not None:
                self.forward_time.observe(seconds, rows, context, work)

    def choose(
        self,
        sampling: SamplingParams,
        k_max: int,
        streams: int = 1,
        match: int | None = None,
        members: int | None = None,
    ) -> int:
        """k* for the next step of the ``members`` (None: all) of ``streams`` streams sampling with
        ``sampling`` (one step of that setting), or for one free draft of evidence class ``match``."""
        with self._lock:
            estimate = self._estimate(sampling, match)
            estimate.step()
            alpha = estimate.optimistic(k_max, self.optimism)
            streams = max(1, streams)
            members = streams if members is None else members
            return best_chain_length(alpha, k_max, self.t_curve, self.cost_for(members), streams, members)

    def choose_tree(
        self,
        sampling: SamplingParams,
        k_max: int,
        streams: int = 1,
        context: int | None = None,
        members: int | None = None,
        extra_rows: int = 0,
    ) -> tuple[int, int]:
        """(k*, w*) for the next step of the ``members`` (None: all) of ``streams`` streams that sample with
        ``sampling``, ``context`` tokens between all of them: a chain of k* tokens whose first has w* - 1
        runners-up beside it (``shapes.fan_chain_tree``); k* = 0: no draft. The other streams of the forward
        take one row each, plus the ``extra_rows`` of the groups that drafted before this one in the step (a
        mixed step: greedy evaluations beside temperature-1 thoughts)."""
        with self._lock:
            estimate = self._estimate(sampling, None)
            estimate.step()
            alpha = estimate.optimistic(k_max, self.optimism)
            runners_up: list[float] = []
            if self.max_width > 1:
                ranks = self._runners_up(sampling)
                ranks.step()
                runners_up = ranks.alpha(self.max_width - 1)  # means: w - 1 upper bounds would add up
            streams = max(1, streams)
            members = streams if members is None else members
            t, c = self.t_curve, self.cost_for(members)
            model = self.forward_time
            if model is not None and self.learn_cost and context is not None:  # in seconds
                t = lambda n: model.seconds(n, context, n / streams * context)  # noqa: E731
                d = self.draft_seconds(members)
                c = d if d is not None else self.draft_cost * model.seconds(1, model.context, model.context)
            return best_fan_chain(alpha, runners_up, k_max, self.max_width, t, c, streams, members, extra_rows)

    def observe(
        self,
        sampling: SamplingParams,
        proposed: int,
        accepted: int,
        match: int | None = None,
        width: int = 1,
        rank: int | None = None,
    ) -> None:
        """A verified chain of ``proposed`` tokens, ``accepted`` of them; with ``width`` > 1 the first token's
        runners-up (ranks 2..width) were verified too, ``rank`` the one accepted (None: none of them)."""
        with self._lock:
            if proposed > 0:
                self._estimate(sampling, match).observe(proposed, accepted)
            if width > 1:
                accepted_runner_up = rank - 2 if rank is not None and rank >= 2 else None
                self._runners_up(sampling).observe_alternatives(width - 1, accepted_runner_up)

    def _runners_up(self, sampling: SamplingParams) -> AcceptanceEstimate:
        if sampling not in self.runners_up:
            prior = self.runner_up_priors[sampling.nearest(self.runner_up_priors)]
            self.runners_up[sampling] = AcceptanceEstimate(prior, self.weight, self.decay)
        return self.runners_up[sampling]

    def _estimate(self, sampling: SamplingParams, match: int | None) -> AcceptanceEstimate:
        if (sampling, match) not in self.estimates:
            prior = self.priors[sampling.nearest(self.priors)]
            self.estimates[(sampling, match)] = AcceptanceEstimate(prior, self.weight, self.decay)
        return self.estimates[(sampling, match)]


def fan_chain_outcome(
    parents: Sequence[int] | None, size: int, width: int, path: Sequence[int]
) -> tuple[int, int, int]:
    """(chain tokens proposed, of them accepted, rank accepted at depth 1 or 0) of a verified fan-and-chain draft
    of ``size`` tokens: tokens 0..width-1 are the first token's ranks 1..width, the chain below rank 1 continues
    at tokens width, width + 1, ... (``parents``: each token's parent token, -1 the root; None: a chain), and any
    tokens past them are grafted (a prompt-lookup branch). ``path``: the accepted tree nodes, root (0) first.

    Worked example: fan_chain_tree(3, 3) as a draft, parents [-1, -1, -1, 0, 3], path [0, 1, 4]: the chain is
    tokens 0, 3, 4 (nodes 1, 4, 5), two of them accepted, at rank 1 -> (3, 2, 1).
    """
    parent = (lambda i: i - 1) if parents is None else (lambda i: parents[i])  # noqa: E731
    chain = [0] if size else []
    while chain and (nxt := width + len(chain) - 1) < size and parent(nxt) == chain[-1]:
        chain.append(nxt)
    accepted = 0
    while accepted < min(len(chain), len(path) - 1) and path[accepted + 1] == chain[accepted] + 1:
        accepted += 1
    rank = path[1] if len(path) > 1 and path[1] <= width else 0
    return len(chain), accepted, rank


class ForwardTime:
    """Seconds of one target forward, verification included, as s = b . x, x = (1, n, K / 1000, R / 1000) (see
    the module docstring), by exponentially weighted least squares (forgetting ``gamma`` per forward) on top of
    the offline profile's (n, seconds) points as pseudo-forwards of one stream after ``context`` tokens, each
    worth ``prior_weight`` forwards and never forgotten.

    Worked example: profile [(1, 0.010), (8, 0.017)] after 256 tokens; the prior alone prices one row at
    0.010 s and each extra row at ~1 ms, whatever the context (it has seen one context only); forwards timed
    at other contexts then fit b_2 and b_3.
    """

    def __init__(
        self, profile: Sequence[tuple[int, float]], context: int, prior_weight: float = 4.0, gamma: float = 0.995
    ) -> None:
        if not profile or not 0.0 < gamma <= 1.0 or prior_weight <= 0.0 or context < 0:
            raise ValueError(f"need profile points, gamma in (0, 1], prior_weight > 0, context >= 0; got {gamma}")
        self.context, self.gamma = context, gamma
        # the prior sees one context only, so its context terms (K, R) are collinear with the intercept and the rows:
        # a ridge on them alone keeps b_2 = b_3 = 0 until forwards at other contexts fit them (a uniform whisper
        # split the time between them, and a long context priced rows dearer than any forward had shown)
        self._prior_a = np.diag([1e-9, 1e-9, 1e-3, 1e-3])
        self._prior_b = np.zeros(4)
        for n, seconds in profile:
            x = self.features(n, context, n * context)
            self._prior_a += prior_weight * np.outer(x, x)
            self._prior_b += prior_weight * seconds * x
        self._a, self._b = np.zeros((4, 4)), np.zeros(4)
        self._beta: np.ndarray | None = None

    @staticmethod
    def features(rows: float, context: float, work: float) -> np.ndarray:
        return np.array([1.0, rows, context / 1000.0, work / 1000.0])

    def observe(self, seconds: float, rows: int, context: int, work: int) -> None:
        x = self.features(rows, context, work)
        self._a = self.gamma * self._a + np.outer(x, x)
        self._b = self.gamma * self._b + seconds * x
        self._beta = None

    def seconds(self, rows: float, context: float, work: float) -> float:
        if self._beta is None:
            self._beta = np.linalg.solve(self._prior_a + self._a, self._prior_b + self._b)
        return max(float(self._beta @ self.features(rows, context, work)), 1e-6)


def _moving_average(average: float | None, value: float, weight: float) -> float:
    """The first value as it is, then average + weight (value - average)."""
    return value if average is None else average + weight * (value - average)
