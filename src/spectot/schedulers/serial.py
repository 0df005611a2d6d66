"""Serial engines — SEED's baselines: the level's streams one after another, each decoded alone.

``ar`` (no draft), ``sd`` (a chain draft), ``mcsd`` (a ``k_config`` tree draft) differ only in the
decoder's proposer. Streams with the same prompt still share its KV (a prompt is run once per level),
so the baselines pay no repeated prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

from spectot.schedulers.base import Level, Recorder
from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import Decoder, StreamResult


@dataclass
class SerialEngine:
    decoder: Decoder
    name: str = "ar"

    def run(self, level: Level, timeline: Timeline | None = None) -> list[StreamResult]:
        rec = Recorder(timeline, level)
        with self.decoder.session(level.prompts, level.config, level.seeds) as session:
            for s in session.streams:
                t = rec.now()
                session.prefill([s])
                rec.add([s.key], "verify", t, rec.now())
                while s.finish is None:
                    t = rec.now()
                    [draft] = session.propose([s])
                    t_verify = rec.now()
                    session.verify([s], [draft])
                    rec.add([s.key], "draft", t, t_verify)
                    rec.add([s.key], "verify", t_verify, rec.now())
        return session.results()
