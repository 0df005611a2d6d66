"""Sequoia's hardware-aware choice of tree size and depth, as pure functions of a measured cost curve.

Sequoia (Chen et al. 2024, section 3.3) picks the tree size n and depth d that maximise

    speed(n, d) = G(n, d) / (t(n) + d * c)

with G(n, d) the best expected tokens per verification step (acceptance length including the bonus
token, the Sequoia DP's table in ``sequoia.py``), t(n) the time of one target forward over n tree tokens
relative to one token (t(1) = 1) and c the time of one draft step relative to one target step.

Depth convention. In spectot the root is the pending token (already sampled, not drafted) and it has
depth 1, so a tree of depth d takes d - 1 draft forwards: this module charges (d - 1) * c. That is
Sequoia's rule with depth counted from the root; n = d = 1 is plain autoregressive decoding (G = 1, time 1).
A draft whose first forward of a step costs more than the others (it catches up on the tokens verification
accepted: ``spectot tree profile``'s c against c_extra_depth) is charged c_first + (d - 2) * c instead.

t(n) as measured is noisy; the model reads it as non-decreasing (a point below an earlier one is lifted to it:
more rows never cost less) and, past the last point, growing by at least the average slope of the whole curve,
(t_last - 1) / (n_last - 1): a dip in the last segment must not make every larger forward free.

Streams. B streams share every forward: each gets its own n-node tree, so one target forward covers
B * n tokens and costs t(B * n); draft steps of all streams are batched too, so one draft step costs
c (a float: Sequoia's constant, independent of the batch) or c(B) (a callable of the rows in one
batched draft forward, taken as one row per stream). Autoregressive decoding of the same B streams
yields one token per stream per t(B), hence

    speedup(n, d, B) = [G(n, d) / (t(B * n) + (d - 1) * c)] / [1 / t(B)].

Times are in units of one single-token target forward; speed is tokens per stream per unit.

Worked example: acceptance (0.8, 0.1) gives G(2, 2) = 1.8, G(3, 2) = 1.9, G(3, 3) = 2.44 (a chain of 3).
With t measured at n = 1, 2, 4 as 1, 1.2, 2.0 (so t(3) = 1.6, t(6) = 2.8 by the slope 0.4 of the last
segment) and c = 0.1:

    B = 1: speedup(2, 2) = 1.8 / (1.2 + 0.1) = 1.385   beats   speedup(3, 3) = 2.44 / (1.6 + 0.2) = 1.356
    B = 3: speedup(2, 2) = 1.8 * 1.6 / (2.8 + 0.1) = 0.993 < 1, so plain decoding (n = d = 1) wins.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TCurve:
    """Measured relative target-forward times t(n), piecewise linear between points.

    ``points`` are (n, t(n)) with n strictly increasing from n = 1 and t(1) = 1, as measured; t is read off
    their running maximum (non-decreasing), linear between them and, past the last point, growing with the
    larger of the last segment's slope and the whole curve's average slope.
    """

    points: tuple[tuple[int, float], ...]  # ((1, 1.0), (n_2, t_2), ...), n strictly increasing

    def __post_init__(self) -> None:
        points = tuple((_check_count("n", n), float(t)) for n, t in self.points)
        if not points:
            raise ValueError("a TCurve needs at least the point (1, 1.0)")
        bad = [t for _, t in points if not (math.isfinite(t) and t > 0.0)]
        if bad:
            raise ValueError(f"t(n) must be positive and finite, got {bad}")
        ns = [n for n, _ in points]
        if any(b <= a for a, b in zip(ns, ns[1:])):
            raise ValueError(
                f"n must be strictly increasing without duplicates, got {ns}; use from_measurements to sort"
            )
        if ns[0] != 1 or not math.isclose(points[0][1], 1.0, rel_tol=1e-9):
            raise ValueError(
                f"a TCurve is relative: it must start at (1, 1.0), got {points[0]}; "
                "use TCurve.from_measurements to normalise absolute times by t(1)"
            )
        object.__setattr__(self, "points", points)

    @classmethod
    def from_measurements(cls, data: Mapping | Iterable, normalise: bool = True) -> TCurve:
        """From {n: t} (JSON string keys allowed) or [{"n": n, "t": t}, ...], in any order.

        With ``normalise`` the times may be absolute (ms, s): they are divided by t(1).
        """
        if isinstance(data, Mapping):
            pairs = [(n, t) for n, t in data.items()]
        else:
            try:
                pairs = [(record["n"], record["t"]) for record in data]
            except (KeyError, TypeError) as err:
                raise ValueError(f'measurements must be {{n: t}} or [{{"n": n, "t": t}}, ...], got {data!r}') from err
        points = sorted((_check_count("n", _as_int(n)), _as_float(t)) for n, t in pairs)
        if normalise:
            t1 = dict(points).get(1)
            if t1 is None or not (math.isfinite(t1) and t1 > 0.0):
                raise ValueError(f"cannot normalise: measure t(1) (a positive time at n = 1), got points {points}")
            points = [(n, t / t1) for n, t in points]
        return cls(tuple(points))

    @classmethod
    def from_json(cls, text: str, normalise: bool = True) -> TCurve:
        """``from_measurements`` of a JSON document (the inverse of ``json.dumps(curve.to_records())``)."""
        return cls.from_measurements(json.loads(text), normalise=normalise)

    def to_records(self) -> list[dict[str, float]]:
        return [{"n": n, "t": t} for n, t in self.points]

    def __call__(self, n: float) -> float:
        """t(n): linear between the points' running maximum, linear past the last one (see the class doc)."""
        if not n >= 1:
            raise ValueError(f"t(n) is defined for n >= 1 tokens, got {n}")
        points = self.envelope()
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        n_last, t_last = points[-1]
        if len(points) == 1:
            return t_last
        n_prev, t_prev = points[-2]
        slope = max((t_last - t_prev) / (n_last - n_prev), (t_last - 1.0) / (n_last - 1))
        return t_last + slope * (n - n_last)

    def envelope(self) -> list[tuple[int, float]]:
        """The points with each t lifted to the largest t measured at a smaller n (running maximum)."""
        lifted, top = [], 0.0
        for n, t in self.points:
            top = max(top, t)
            lifted.append((n, top))
        return lifted


@dataclass(frozen=True)
class SizingChoice:
    """The (n, d) maximising speed for a given number of streams, and the grid it was chosen from."""

    n: int  # tree nodes per stream, root included (n = 1: plain decoding)
    d: int  # tree depth, root at depth 1: d - 1 draft forwards per step
    streams: int  # B: streams sharing each forward
    tokens_per_step: float  # G(n, d), acceptance length per stream including the bonus token
    step_time: float  # t(B * n) + (d - 1) * c, in single-token target forwards
    speed: float  # G(n, d) / step_time, tokens per stream per unit time
    speedup_vs_ar: float  # speed * t(B): against plain decoding of the same B streams
    speedup_grid: tuple[tuple[float, ...], ...]  # [n][d] like the table (index 0 unused); 0.0 where infeasible


def step_time(
    n: int,
    d: int,
    t_curve: Callable[[float], float],
    draft_cost: float | Callable[[int], float],
    streams: int = 1,
    first_draft_cost: float | None = None,
) -> float:
    """t(B * n) + (d - 1) * c: one batched target forward over B trees plus d - 1 batched draft steps; with
    ``first_draft_cost`` c_1 (a first draft forward that also catches up), t(B * n) + c_1 + (d - 2) * c."""
    if d <= 1:
        return t_curve(streams * n)
    c = _draft_step_cost(draft_cost, streams)
    first = c if first_draft_cost is None else _draft_step_cost(first_draft_cost, streams)
    return t_curve(streams * n) + first + (d - 2) * c


def predicted_speedup(
    tokens_per_step: float,
    n: int,
    d: int,
    t_curve: Callable[[float], float],
    draft_cost: float | Callable[[int], float],
    streams: int = 1,
    first_draft_cost: float | None = None,
) -> float:
    """[G / (t(B n) + (d - 1) c)] / [1 / t(B)]: tokens per unit time against plain decoding of B streams.

    ``tokens_per_step`` is G(n, d). ``draft_cost`` is c (a float) or c(rows) for one batched draft step
    of ``streams`` rows; ``first_draft_cost``: see ``step_time``.
    """
    return tokens_per_step * t_curve(streams) / step_time(n, d, t_curve, draft_cost, streams, first_draft_cost)


def choose_tree_size(
    table: Sequence[Sequence[float]],
    t_curve: Callable[[float], float],
    draft_cost: float | Callable[[int], float],
    streams: int = 1,
    max_nodes: int | None = None,
    first_draft_cost: float | None = None,
) -> SizingChoice:
    """argmax over (n, d) of G(n, d) / (t(B n) + (d - 1) c), with n <= max_nodes (``first_draft_cost``: the
    first draft forward's own cost, see ``step_time``).

    ``table[n][d]`` = G(n, d) as in ``SequoiaTree.table``; non-finite entries (no such tree) are skipped.
    Ties go to the smaller n, then the smaller d, so the chosen d is the fewest draft steps reaching G.
    """
    _check_count("streams", streams)
    n_max = _check_table(table)
    if max_nodes is not None:
        n_max = min(n_max, _check_count("max_nodes", max_nodes))
    depth = len(table[1]) - 1
    grid = [[0.0] * (depth + 1) for _ in range(len(table))]
    best = (-math.inf, 1, 1)
    for n in range(1, n_max + 1):
        for d in range(1, depth + 1):
            g = table[n][d]
            if not math.isfinite(g):
                continue
            grid[n][d] = predicted_speedup(g, n, d, t_curve, draft_cost, streams, first_draft_cost)
            if grid[n][d] > best[0] * (1.0 + 1e-12):
                best = (grid[n][d], n, d)
    speedup, n, d = best
    time = step_time(n, d, t_curve, draft_cost, streams, first_draft_cost)
    return SizingChoice(
        n=n,
        d=d,
        streams=streams,
        tokens_per_step=table[n][d],
        step_time=time,
        speed=table[n][d] / time,
        speedup_vs_ar=speedup,
        speedup_grid=tuple(tuple(row) for row in grid),
    )


def per_stream_budget(
    table: Sequence[Sequence[float]],
    t_curve: Callable[[float], float],
    draft_cost: float | Callable[[int], float],
    streams_options: Iterable[int],
    max_nodes: int | None = None,
    first_draft_cost: float | None = None,
) -> dict[int, SizingChoice]:
    """{B: choose_tree_size(..., streams=B)}: few streams afford big trees, many streams small ones."""
    return {b: choose_tree_size(table, t_curve, draft_cost, b, max_nodes, first_draft_cost) for b in streams_options}


def _draft_step_cost(draft_cost: float | Callable[[int], float], streams: int) -> float:
    """c, or c(B) for a draft forward batching one row per stream; checked non-negative and finite."""
    cost = float(draft_cost(streams) if callable(draft_cost) else draft_cost)
    if not (math.isfinite(cost) and cost >= 0.0):
        raise ValueError(f"the draft step cost must be finite and >= 0 (relative to a target step), got {cost}")
    return cost


def _check_table(table: Sequence[Sequence[float]]) -> int:
    """The largest n of a G(n, d) table laid out like ``SequoiaTree.table``; checks G(1, 1) = 1."""
    if len(table) < 2 or len(table[1]) < 2 or any(len(row) != len(table[1]) for row in table[1:]):
        raise ValueError(
            "table must be rectangular with table[n][d] for n, d >= 1 (index 0 unused), as SequoiaTree.table"
        )
    if table[1][1] != 1.0:
        raise ValueError(f"table[1][1] = G(1, 1) must be 1 (the root alone yields one token), got {table[1][1]}")
    return len(table) - 1


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _as_int(value) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"n must be a positive integer, got {value!r}") from err
    if not number.is_integer():
        raise ValueError(f"n must be a positive integer, got {value!r}")
    return int(number)


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"t must be a number, got {value!r}") from err
