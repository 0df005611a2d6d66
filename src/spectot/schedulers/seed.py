"""SEED's scheduled speculative execution (Wang et al. 2024, Algorithm 2) for one tree level.

Drafting and verification run concurrently: a drafter thread drafts streams while the target
verifies others. The pieces, in the paper's words:

- *draft label map*: a stream is drafted again only after its previous draft was verified (a
  stream is in one phase at a time: drafting, waiting in the queue, or being verified);
- *FCFS verification queue*: finished drafts wait in arrival order; the target takes the oldest
  (``seed``: one per round, as in the paper) or every waiting one in one forward (``seed-batched``:
  several streams' trees verified together, each tree sized for the number of streams still running
  by ``budget``; the drafter also drafts every waiting stream in one batched call);
- *rounds*: verify -> the stream returns to the drafter -> ... until all n streams finish.

Losslessness does not depend on the schedule: each stream's draft is verified against the target
exactly as in serial speculative decoding, with the stream's own random source. Timings go to the
timeline: draft (drafter busy with the stream), wait (draft done, queued), verify.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from spectot.schedulers.base import Level, Recorder
from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import Decoder, StreamResult
from spectot.spec.trees.dynamic import TreeBudget


@dataclass
class SeedEngine:
    decoder: Decoder
    name: str = "seed"
    batched: bool = False  # seed-batched: verify every queued stream in one forward, draft waiting streams together
    budget: TreeBudget | None = None  # (streams B, sampling) -> tree per stream (batched)

    def run(self, level: Level, timeline: Timeline | None = None) -> list[StreamResult]:
        if self.decoder.proposer is None:
            raise ValueError(f"engine '{self.name}' needs a draft (--draft)")
        rec = Recorder(timeline, level)
        with self.decoder.session(level.prompts, level.config, level.seeds) as session:
            t = rec.now()
            session.prefill(session.streams)
            rec.add([s.key for s in session.streams], "verify", t, rec.now())
            _Rounds(session, rec, self.batched, self.budget).run([s for s in session.streams if s.finish is None])
        return session.results()


class _Rounds:
    """The drafter thread and the target loop of one level, sharing the two queues under one lock."""

    def __init__(self, session, rec: Recorder, batched: bool, budget) -> None:
        self.session, self.rec, self.batched, self.budget = session, rec, batched, budget
        self.cond = threading.Condition()
        self.to_draft: deque = deque()  # streams whose last draft was verified (the label map's "free")
        self.queue: deque = deque()  # FCFS: (stream, draft, time the draft was ready)
        self.running = 0  # streams not finished
        self.error: BaseException | None = None
        self.done = False

    def run(self, streams: list) -> None:
        self.running = len(streams)
        self.to_draft.extend(streams)
        drafter = threading.Thread(target=self._drafter, name="spectot-seed-drafter", daemon=True)
        drafter.start()
        try:
            self._target()
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()
            drafter.join()
        if self.error is not None:
            raise self.error

    # -- drafter thread ---------------------------------------------------------------------
    def _drafter(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.to_draft or self.done)
                    if self.done:
                        return
                    batch = list(self.to_draft) if self.batched else [self.to_draft[0]]
                    for _ in batch:
                        self.to_draft.popleft()
                    running = self.running
                # off the lock: a stream count's first tree runs Sequoia's DP, and the target hands streams back
                policy = self.budget(running, self.session.config.sampling) if self.budget else None
                t = self.rec.now()
                drafts = self.session.propose(batch, policy)
                end = self.rec.now()
                self.rec.add([s.key for s in batch], "draft", t, end)
                with self.cond:
                    self.queue.extend((s, d, end) for s, d in zip(batch, drafts))
                    self.cond.notify_all()
        except BaseException as err:  # surfaced by the target loop
            with self.cond:
                self.error = err
                self.cond.notify_all()

    # -- target loop (the calling thread) ------------------------------------------------------
    def _target(self) -> None:
        while self.running:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.error is not None)
                if self.error is not None:
                    return
                picked = list(self.queue) if self.batched else [self.queue[0]]
                for _ in picked:
                    self.queue.popleft()
            streams = [s for s, _, _ in picked]
            t = self.rec.now()
            for s, _, ready in picked:
                self.rec.add([s.key], "wait", ready, t)
            self.session.verify(streams, [d for _, d, _ in picked])
            self.rec.add([s.key for s in streams], "verify", t, self.rec.now())
            with self.cond:
                for s in streams:
                    if s.finish is None:
                        self.to_draft.append(s)
                    else:
                        self.running -= 1
                self.cond.notify_all()
