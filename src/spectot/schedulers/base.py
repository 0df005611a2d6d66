"""What every execution engine of a tree level shares: the level's request and the engine interface.

A *level* is the set of generations one search step needs at once: the n thoughts G samples for each
kept state, or the n evaluations E runs on the new states. An engine runs them all and returns one
``StreamResult`` per prompt, in order; engines differ only in how they schedule the target and the
draft, never in what they return (greedy output is token-for-token the same, sampled output has the
target's distribution). Engines record draft / wait / verify intervals per stream on a ``Timeline``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import DecodeConfig, StreamResult


@dataclass(frozen=True)
class Level:
    prompts: Sequence[Sequence[int]]  # token ids, one per stream
    config: DecodeConfig
    seeds: Sequence[int]  # one per stream: its samples depend on nothing else
    index: int = 0  # the level's number in the run (for the timeline)
    component: str = ""  # "TG" or "SE"

    def __post_init__(self) -> None:
        if len(self.seeds) != len(self.prompts):
            raise ValueError(f"a level needs one seed per prompt: {len(self.seeds)} seeds, {len(self.prompts)} prompts")

    @classmethod
    def make_dummy(cls, n: int = 3, max_new_tokens: int = 8) -> Level:
        return cls([[1, 2, 3]] * n, DecodeConfig(max_new_tokens=max_new_tokens), list(range(n)))


@dataclass
class Recorder:
    """Adds intervals of one level to a timeline (or nowhere when there is none)."""

    timeline: Timeline | None
    level: Level

    def now(self) -> float:
        return self.timeline.clock() if self.timeline is not None else 0.0

    def add(self, streams: Sequence[int], phase: str, start: float, end: float) -> None:
        if self.timeline is None:
            return
        for s in streams:
            self.timeline.add(s, phase, start, end, self.level.index, self.level.component)


class Engine(Protocol):
    name: str

    def run(self, level: Level, timeline: Timeline | None = None) -> list[StreamResult]: ...
