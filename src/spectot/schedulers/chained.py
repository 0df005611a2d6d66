"""Continuous level engines: a level's streams join the continuous engine, and each stream's
follow-up (ToT: the evaluation of the state its thought made) joins as soon as that stream ends.

The batched engines run a level to its barrier: the n thoughts decode together, the evaluations wait
for the slowest thought, then run as a batch of their own. Thoughts differ in length (SmolLM2's sampled
GSM8K steps: 44 tokens on average, yet a level of 8 took 114 forwards), so most of a batched level's
forwards carry one or two rows while the target could carry eight at nearly the same cost. Here a
level is a set of requests to one ``ContinuousEngine``:

    submit the n thought streams
    when thought i ends: E's prompt for state i is built from its text and submitted at once
    the level returns when every thought and every evaluation has

so evaluations fill the forwards of the thoughts' long tail. What each stream produces does not
change (it keeps its seed; the engine is batch-invariant), so the searched tree equals ``ar``'s.
``continuous-ar`` decodes plainly, ``continuous-sd`` with the draft (trees sized by the number of live
streams when a budget is given).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from spectot.schedulers.base import Level
from spectot.schedulers.continuous import ContinuousEngine
from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import DecodeConfig, StreamResult

# (stream i, its result) -> the follow-up's (prompt, decoding config, seed)
FollowUp = Callable[[int, StreamResult], tuple[Sequence[int], DecodeConfig, int]]


@dataclass
class ChainedRun:
    first: list[StreamResult]  # the level's streams, in order
    then: list[StreamResult]  # each one's follow-up, in the same order
    first_seconds: float  # until the last first-stage stream ended
    seconds: float  # until everything ended
    first_forwards: int  # target forwards until then, prefills too (engine-wide: other callers' streams share them)
    forwards: int


class ContinuousLevelEngine:
    def __init__(self, engine: ContinuousEngine, name: str = "continuous-ar") -> None:
        self.engine, self.name = engine, name

    def run(self, level: Level, timeline: Timeline | None = None) -> list[StreamResult]:
        """The level alone (no follow-up): every stream submitted at once, results in order."""
        futures = [self.engine.submit(p, level.config, seed) for p, seed in zip(level.prompts, level.seeds)]
        try:
            return [f.result() for f in futures]
        except BaseException:  # a failed stream fails the level: its siblings stop decoding for nobody
            for f in futures:
                f.cancel()
            raise

    def run_chained(self, level: Level, follow: FollowUp) -> ChainedRun:
        """The level, and for each stream the follow-up ``follow(i, result)``, submitted the moment
        stream i ends."""
        t0, forwards0 = time.perf_counter(), self.engine.counters.target_forwards
        first = [self.engine.submit(p, level.config, seed) for p, seed in zip(level.prompts, level.seeds)]
        stage: dict[Future, tuple[int, int]] = {f: (0, i) for i, f in enumerate(first)}
        second: list[Future | None] = [None] * len(first)
        pending, first_left = set(first), len(first)
        first_seconds, first_forwards = 0.0, 0
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    kind, i = stage[f]
                    if kind == 1:
                        f.result()  # a failed follow-up raises at once
                        continue
                    second[i] = self.engine.submit(*follow(i, f.result()))  # a failed stream raises here
                    stage[second[i]] = (1, i)
                    pending.add(second[i])
                    first_left -= 1
                    if first_left == 0:
                        first_forwards = self.engine.counters.target_forwards - forwards0
                        first_seconds = time.perf_counter() - t0
        except BaseException:
            for f in pending:
                f.cancel()
            raise
        return ChainedRun(
            [f.result() for f in first],
            [f.result() for f in second],
            first_seconds,
            time.perf_counter() - t0,
            first_forwards,
            self.engine.counters.target_forwards - forwards0,
        )

    def close(self) -> None:
        self.engine.close()
