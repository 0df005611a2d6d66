"""Rich progress bars for long jobs (benchmarks, training), and the plots benchmarks draw."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

logger = logging.getLogger(__name__)


class _Progress(Progress):
    """A bar that leaves nothing behind when its job fails before any unit is done: an empty bar above a startup
    error (a server that cannot be reached, a model that does not load) says nothing but looks like work."""

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:  # type: ignore[no-untyped-def]
        if exc_type is not None and not any(task.completed for task in self.tasks):
            self.live.transient = True
        super().__exit__(exc_type, exc_val, exc_tb)


def progress_bar() -> Progress:
    """Elapsed time and ETA; the speed is averaged over the last hour (rich's default 30 s leaves no ETA when one
    unit, e.g. a problem of ``bench tot``, takes longer than that)."""
    return _Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        speed_estimate_period=3600,
    )


def pyplot(path: Path) -> ModuleType | None:
    """matplotlib's pyplot on a file backend, or None (a warning naming the plot ``path`` skipped) where it is not
    installed: a benchmark's results are written before its plot, so they never depend on it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed: skipping %s (pip install 'spectot[bench]')", path)
        return None
    return plt
