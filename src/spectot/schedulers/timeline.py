"""Per-stream timelines of a scheduled run: when each stream drafted, waited and was verified.

SEED's figure 3(b) draws these as a Gantt chart; the fraction of wall time in which the target is
verifying something is the *target utilisation* the scheduler tries to raise. Times are seconds
since the timeline's origin (``Timeline.clock()`` at creation).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

Phase = Literal["draft", "wait", "verify"]


@dataclass(frozen=True)
class Interval:
    stream: int  # the stream's index in its level (0..n-1)
    phase: Phase
    start: float  # seconds since the origin
    end: float
    level: int = 0  # which tree level / scheduled batch the stream belongs to
    component: str = ""  # "TG" (thought generation) or "SE" (state evaluation)


@dataclass
class Timeline:
    intervals: list[Interval] = field(default_factory=list)
    origin: float = field(default_factory=time.perf_counter)

    def clock(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, stream: int, phase: Phase, start: float, end: float, level: int = 0, component: str = "") -> None:
        if end > start:
            self.intervals.append(Interval(stream, phase, start, end, level, component))

    def wall_time(self) -> float:
        if not self.intervals:
            return 0.0
        return max(i.end for i in self.intervals) - min(i.start for i in self.intervals)

    def target_utilisation(self) -> float:
        """Share of the wall time covered by at least one verify interval (the target busy)."""
        spans = sorted((i.start, i.end) for i in self.intervals if i.phase == "verify")
        busy, reach = 0.0, float("-inf")
        for start, end in spans:  # union of intervals
            if end > reach:
                busy += end - max(start, reach)
                reach = end
        wall = self.wall_time()
        return busy / wall if wall > 0 else 0.0

    def to_json(self) -> dict:
        return {"intervals": [asdict(i) for i in self.intervals]}

    @classmethod
    def from_json(cls, obj: dict) -> Timeline:
        return cls([_checked(Interval(**i)) for i in obj["intervals"]], origin=0.0)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        from spectot.data.jsonl import DataError

        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise DataError(f"{path}: no such file") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}: not a spectot trace (expected {{'intervals': [...]}}; {err})") from None


def _checked(interval: Interval) -> Interval:
    """An interval read from a file (hand-edited, maybe): named when wrong, not a TypeError or a negative wall
    time later. ``Timeline.add`` makes only well-formed ones, so the recording path skips this."""
    if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in (interval.start, interval.end)):
        raise ValueError(f"an interval's start and end are seconds, got {interval.start!r}, {interval.end!r}")
    if interval.end < interval.start:
        raise ValueError(f"an interval ends ({interval.end}) before it starts ({interval.start})")
    if interval.phase not in get_args(Phase):
        raise ValueError(f"an interval's phase is draft, wait or verify, got {interval.phase!r}")
    return interval
