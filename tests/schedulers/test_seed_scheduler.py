"""SEED's scheduler under random draft and verify durations (a property test over many seeds).

The drafter is a real n-gram proposer slowed down by random sleeps, and the target's verification
is slowed by random sleeps too, so the drafter thread and the target loop interleave differently
in every run. Whatever the interleaving: every stream finishes with exactly serial AR's tokens, no
draft is verified twice (one verification per draft), and every stream keeps being served.
"""

from __future__ import annotations

import random
import time

import pytest

from spectot.engine.runner import ModelRunner
from spectot.schedulers.base import Level
from spectot.schedulers.seed import SeedEngine
from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import DecodeConfig, Decoder, DecodeSession
from spectot.spec.proposers.ngram import NgramProposer

PROMPTS = [[1, 2, 3, 1, 2], [7, 7, 8, 7, 7], [4, 5], [9, 1, 9, 1, 9], [2, 3, 4, 2, 3]]
MAX_NEW = 12


class SlowNgram(NgramProposer):
    """n-gram drafts after a random pause; counts drafts per stream."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__(width=1)
        self.rng, self.drafts = rng, {}

    def propose(self, requests, params, generator):
        time.sleep(self.rng.uniform(0, 0.004))
        for r in requests:
            self.drafts[r.key] = self.drafts.get(r.key, 0) + 1
        return super().propose(requests, params, generator)


@pytest.mark.parametrize("batched", [False, True], ids=["seed", "seed-batched"])
@pytest.mark.parametrize("trial", range(6))
def test_random_timings_never_change_the_result(tiny_llama, monkeypatch, batched: bool, trial: int) -> None:
    target = tiny_llama(0)
    reference = [
        Decoder(ModelRunner(target)).generate([p], DecodeConfig(max_new_tokens=MAX_NEW))[0].token_ids for p in PROMPTS
    ]
    rng = random.Random(trial)
    verify = DecodeSession.verify

    def slow_verify(self, streams, drafts):
        time.sleep(rng.uniform(0, 0.004))
        return verify(self, streams, drafts)

    monkeypatch.setattr(DecodeSession, "verify", slow_verify)
    proposer = SlowNgram(random.Random(100 + trial))
    engine = SeedEngine(Decoder(ModelRunner(target), proposer=proposer), batched=batched)
    config = DecodeConfig(max_new_tokens=MAX_NEW, method="sd", num_draft_tokens=3)
    timeline = Timeline()
    results = engine.run(Level(PROMPTS, config, list(range(len(PROMPTS)))), timeline)

    assert [r.token_ids for r in results] == reference  # all n finish, exactly
    for key, r in enumerate(results):
        # one verification per draft: never a draft verified twice, never one dropped
        assert proposer.drafts[key] == r.stats.verify_steps
    # FCFS: while a stream waits, the target serves each other stream at most once (no starvation)
    verify_starts = [(i.start, i.stream) for i in timeline.intervals if i.phase == "verify"]
    for w in (i for i in timeline.intervals if i.phase == "wait"):
        served = [s for t, s in verify_starts if w.start < t < w.end and s != w.stream]
        assert len(served) <= len(PROMPTS) - 1
    if not batched:  # one stream per verification round
        verifies = [i for i in timeline.intervals if i.phase == "verify"][len(PROMPTS) :]
        assert len({(i.start, i.end) for i in verifies}) == len(verifies)
