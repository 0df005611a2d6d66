"""Rich progress bars for long jobs (benchmarks, training)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def progress_bar() -> Progress:
    """Elapsed time and ETA; the speed is averaged over the last hour (rich's default 30 s leaves no ETA when one
    unit, e.g. a problem of ``bench tot``, takes longer than that)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        speed_estimate_period=3600,
    )
