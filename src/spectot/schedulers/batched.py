"""Batched engines: every unfinished stream of the level in one target forward per step.

``batched-ar`` is the "Parallel" strategy of SEED's figure 1(d) done well: all n streams laid side by
side in one forward over their shared prompt KV. ``batched-sd`` adds drafts — all streams drafted in
one batched draft call, all their trees verified in one forward — with each stream's tree sized for
the number of streams still running (``budget``: Sequoia's hardware-aware rule, few streams -> big
trees, many -> small).
"""

from __future__ import annotations

from dataclasses import dataclass

from spectot.schedulers.base import Level, Recorder
from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import Decoder, StreamResult
from spectot.spec.trees.dynamic import TreeBudget


@dataclass
class BatchedEngine:
    decoder: Decoder
    name: str = "batched-ar"
    budget: TreeBudget | None = None  # (streams B, sampling) -> tree per stream (None: the proposer's)

    def run(self, level: Level, timeline: Timeline | None = None) -> list[StreamResult]:
        rec = Recorder(timeline, level)
        with self.decoder.session(level.prompts, level.config, level.seeds) as session:
            t = rec.now()
            session.prefill(session.streams)
            active = [s for s in session.streams if s.finish is None]
            rec.add([s.key for s in session.streams], "verify", t, rec.now())
            while active:
                keys = [s.key for s in active]
                policy = self.budget(len(active), level.config.sampling) if self.budget is not None else None
                t = rec.now()
                drafts = session.propose(active, policy)
                t_verify = rec.now()
                session.verify(active, drafts)
                rec.add(keys, "draft", t, t_verify)
                rec.add(keys, "verify", t_verify, rec.now())
                active = [s for s in active if s.finish is None]
        return session.results()
