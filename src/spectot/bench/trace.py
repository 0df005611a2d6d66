"""Reading a scheduler ``Timeline``: summary numbers, a Markdown table and a Gantt chart (SEED fig. 3(b)).

Vocabulary (see ``spectot.schedulers.timeline``):

- *phase seconds* sum interval lengths, so they are stream-seconds: two streams drafting for 1 s
  at the same time count 2 s of draft.
- *target busy* is the length of the union of verify intervals: two overlapping verifies count once,
  because the target serves them in one batched forward. *Target utilisation* = target busy / wall time.

Worked example: verifies on [1, 2] and [1.5, 2.5] plus one on [3, 4], wall time [0, 4]:
busy = 1.5 + 1 = 2.5 s, utilisation = 2.5 / 4 = 62.5 %, verify phase seconds = 3 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path

from spectot.schedulers.timeline import Interval, Phase, Timeline

PHASES: tuple[Phase, ...] = ("draft", "wait", "verify")
UNLABELLED = "unlabelled"  # component name used for intervals recorded without one

# Gantt colours: draft and verify strong, wait light grey so idle streams read as gaps.
PHASE_COLOURS: dict[str, str] = {"draft": "#4c8bd6", "wait": "#d9d9d9", "verify": "#d6452b"}


# ---------------------------------------------------------------------------------------------- helpers


def merge_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of ``(start, end)`` spans as sorted, disjoint spans: [(1, 2), (1.5, 2.5), (3, 4)] -> [(1, 2.5), (3, 4)]."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``spans`` (overlaps counted once)."""
    return float(sum(end - start for start, end in merge_spans(spans)))


def _phase_seconds(intervals: Iterable[Interval]) -> dict[str, float]:
    totals = dict.fromkeys(PHASES, 0.0)
    for i in intervals:
        totals[i.phase] = totals.get(i.phase, 0.0) + (i.end - i.start)
    return totals


def _verify_spans(intervals: Iterable[Interval]) -> list[tuple[float, float]]:
    return [(i.start, i.end) for i in intervals if i.phase == "verify"]


def _component(interval: Interval) -> str:
    return interval.component or UNLABELLED


def _group(intervals: Iterable[Interval], key: Callable[[Interval], Hashable]) -> dict[Hashable, list[Interval]]:
    groups: dict[Hashable, list[Interval]] = {}
    for i in intervals:
        groups.setdefault(key(i), []).append(i)
    return groups


# ---------------------------------------------------------------------------------------------- summary


def _level_row(level: int, intervals: Sequence[Interval]) -> dict:
    start = min(i.start for i in intervals)
    end = max(i.end for i in intervals)
    wall = end - start
    busy = busy_seconds(_verify_spans(intervals))
    return {
        "level": int(level),
        "component": "+".join(sorted({_component(i) for i in intervals})),
        "start": float(start),
        "end": float(end),
        "wall_time": float(wall),
        "target_busy": busy,
        "target_utilisation": busy / wall if wall > 0 else 0.0,
        "streams": len({i.stream for i in intervals}),
    }


def _component_row(intervals: Sequence[Interval]) -> dict:
    return {
        **_phase_seconds(intervals),
        "target_busy": busy_seconds(_verify_spans(intervals)),
        "verify_intervals": sum(i.phase == "verify" for i in intervals),
        "levels": len({i.level for i in intervals}),
    }


def trace_summary(timeline: Timeline) -> dict:
    """Summary numbers of ``timeline`` as plain floats / ints / strings (JSON-serialisable).

    Keys: ``wall_time``, ``target_busy``, ``target_utilisation`` (0..1), ``intervals``, ``verify_intervals``,
    ``phases`` {phase: stream-seconds}, ``streams`` [{stream, draft, wait, verify}] (stream index summed over
    levels), ``levels`` [{level, component, start, end, wall_time, target_busy, target_utilisation, streams}],
    ``components`` {name: {draft, wait, verify, target_busy, verify_intervals, levels}}.
    An empty timeline gives zeros and empty collections.
    """
    intervals = timeline.intervals
    wall = float(timeline.wall_time())
    busy = busy_seconds(_verify_spans(intervals))
    by_stream = _group(intervals, lambda i: i.stream)
    by_level = _group(intervals, lambda i: i.level)
    by_component = _group(intervals, _component)
    return {
        "wall_time": wall,
        "target_busy": busy,
        "target_utilisation": busy / wall if wall > 0 else 0.0,
        "intervals": len(intervals),
        "verify_intervals": sum(i.phase == "verify" for i in intervals),
        "phases": _phase_seconds(intervals),
        "streams": [{"stream": int(s), **_phase_seconds(by_stream[s])} for s in sorted(by_stream)],
        "levels": [_level_row(level, by_level[level]) for level in sorted(by_level)],
        "components": {name: _component_row(by_component[name]) for name in sorted(by_component)},
    }


def summary_markdown(summary: dict) -> str:
    """A short Markdown report of a ``trace_summary``: utilisation line, phase table, per-component table."""
    util = 100 * summary["target_utilisation"]
    lines = [
        f"target utilisation: **{util:.1f}%** ({summary['target_busy']:.3f} s busy of {summary['wall_time']:.3f} s "
        f"wall, {summary['verify_intervals']} verify intervals, {len(summary['levels'])} levels)",
        "",
        "| phase | stream-seconds |",
        "|---|---:|",
    ]
    lines += [f"| {phase} | {seconds:.3f} |" for phase, seconds in summary["phases"].items()]
    lines += [f"| target busy (union of verify) | {summary['target_busy']:.3f} |"]
    if summary["components"]:
        lines += [
            "",
            "| component | levels | draft s | wait s | verify s | target busy s | verify intervals |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {name} | {row['levels']} | {row['draft']:.3f} | {row['wait']:.3f} | {row['verify']:.3f} | "
            f"{row['target_busy']:.3f} | {row['verify_intervals']} |"
            for name, row in summary["components"].items()
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- Gantt chart


def _bars(intervals: Iterable[Interval], phase: str) -> list[tuple[float, float]]:
    """``(start, width)`` pairs for ``broken_barh``."""
    return [(i.start, i.end - i.start) for i in intervals if i.phase == phase]


def _annotate_levels(ax, levels: Sequence[dict], max_labels: int = 15) -> None:
    """Faint vertical line at each level's start; label every k-th level so ~30 levels stay legible."""
    step = max(1, math.ceil(len(levels) / max_labels))
    for n, row in enumerate(levels):
        ax.axvline(row["start"], color="black", alpha=0.15, linewidth=0.6, zorder=0)
        if n % step == 0:
            tag = f"L{row['level']}" if row["component"] == UNLABELLED else f"L{row['level']} {row['component']}"
            ax.text(
                row["start"],
                1.0,
                tag,
                transform=ax.get_xaxis_transform(),
                fontsize=6,
                ha="left",
                va="bottom",
                color="#555555",
            )


def draw_gantt(timeline: Timeline, out_png: str | Path, title: str = "") -> dict:
    """Draw ``timeline`` as a Gantt chart to ``out_png`` and return its ``trace_summary``.

    One row per stream index (streams of successive levels share a row; level starts are faint vertical
    lines labelled ``L<level>``), plus a top row "target" showing the union of verify intervals.
    """
    if not timeline.intervals:
        raise ValueError(
            f"timeline has no intervals: nothing to draw to {out_png} "
            "(record phases with Timeline.add(stream, phase, start, end) before plotting)"
        )
    from matplotlib.figure import Figure  # lazy; Figure without pyplot needs no global backend switch
    from matplotlib.patches import Patch

    summary = trace_summary(timeline)
    by_stream = _group(timeline.intervals, lambda i: i.stream)
    streams = sorted(by_stream)
    bar_height = 0.7
    fig = Figure(figsize=(12, max(2.5, 1.6 + 0.32 * (len(streams) + 2))))
    ax = fig.add_subplot()

    for row, stream in enumerate(streams):
        for phase in PHASES:
            bars = _bars(by_stream[stream], phase)
            if bars:
                ax.broken_barh(bars, (row - bar_height / 2, bar_height), facecolors=PHASE_COLOURS[phase])
    target_row = -1.5  # above stream 0 once the y axis is inverted, with a small gap
    target = [(start, end - start) for start, end in merge_spans(_verify_spans(timeline.intervals))]
    ax.broken_barh(target, (target_row - bar_height / 2, bar_height), facecolors=PHASE_COLOURS["verify"])

    if len(summary["levels"]) > 1:
        _annotate_levels(ax, summary["levels"])
    ax.set_yticks([target_row, *range(len(streams))], ["target", *(str(s) for s in streams)])
    ax.tick_params(axis="y", labelsize=7 if len(streams) > 12 else 9)
    ax.set_ylim(len(streams) - 0.5, target_row - 0.75)  # inverted: target on top, stream 0 below it
    ax.set_xlim(min(i.start for i in timeline.intervals), max(i.end for i in timeline.intervals))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("stream")
    ax.legend(
        handles=[Patch(facecolor=PHASE_COLOURS[p], label=p) for p in PHASES],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
    )
    heading = f"target utilisation {100 * summary['target_utilisation']:.1f}%"
    ax.set_title(f"{title} ({heading})" if title else heading, pad=14 if len(summary["levels"]) > 1 else 6)

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150, bbox_inches="tight")
    return summary
