"""The policy a search runs: a Thought Generator G and a State Evaluator E over a backend.

A *backend* turns a batch of ``StepRequest`` prompts into texts; the search hands it a whole level
at once, so the backend's engine can schedule the n generations together (SEED). ``LocalBackend``
runs spectot's engine on a local target; a black-box backend (an OpenAI-compatible server) fits the
same two-method interface. Per-component counters (TG / SE) feed the solve summary.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from spectot.spec.decoding import DecodeConfig, cut_at_stop
from spectot.tasks.base import StepRequest


@dataclass
class ComponentStats:
    """Totals over every level one component (TG or SE) ran."""

    levels: int = 0
    streams: int = 0
    new_tokens: int = 0
    verify_steps: int = 0  # per-stream target verifications (the prefill's first token not counted)
    target_forwards: int = 0  # forwards of the target (a batched forward counts once)
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens per target step of a stream (its prefill counts as one), the bonus token
        included: exactly 1.0 for AR."""
        steps = self.verify_steps + self.streams
        return self.new_tokens / steps if steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_step": self.tokens_per_step, "acceptance_rate": self.acceptance_rate}


@dataclass(frozen=True)
class GenerationCall:
    """One level's worth of generation: prompts, their sampling temperature and random seeds."""

    requests: Sequence[StepRequest]
    temperature: float  # 0 = greedy
    seeds: Sequence[int]
    component: str  # "TG" or "SE"


class Backend(Protocol):
    def generate(self, call: GenerationCall) -> list[str]: ...


def stream_seeds(seed: int, *labels: object, n: int) -> list[int]:
    """n seeds for one level, a pure function of the run's seed and the level's labels, so every
    engine draws each stream's samples from the same source."""
    digest = hashlib.blake2b(repr((seed, *labels)).encode(), digest_size=8).digest()
    base = int.from_bytes(digest, "little") >> 2
    return [(base + i) % 2**62 for i in range(n)]


@dataclass
class Policy:
    """G and E: what the search asks for, with the sampling settings of each."""

    backend: Backend
    seed: int = 0
    thought_temperature: float = 1.0  # SEED / ToT sample thoughts at temperature 1
    eval_temperature: float = 0.0

    def generate(self, requests: Sequence[StepRequest], *labels: object) -> list[str]:
        return self._call(requests, self.thought_temperature, "TG", labels)

    def evaluate(self, requests: Sequence[StepRequest], *labels: object) -> list[str]:
        return self._call(requests, self.eval_temperature, "SE", labels)

    def _call(self, requests: Sequence[StepRequest], temperature: float, component: str, labels) -> list[str]:
        if not requests:
            return []
        seeds = stream_seeds(self.seed, component, *labels, n=len(requests))
        return self.backend.generate(GenerationCall(requests, temperature, seeds, component))


@dataclass
class LocalBackend:
    """spectot's engine on a local target: one ``Level`` per group of requests sharing stop strings
    and a token budget (a search level's requests all do)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    engine: object  # schedulers.base.Engine
    method: str  # "ar" or "sd": what the engine's decoder runs
    num_draft_tokens: int = 5
    timeline: object | None = None  # schedulers.timeline.Timeline
    record: Callable[[dict], None] | None = None  # gets every generation's prompt and token ids
    stats: dict[str, ComponentStats] = field(default_factory=dict)
    levels: int = 0

    def generate(self, call: GenerationCall) -> list[str]:
        from spectot.schedulers.base import Level
        from spectot.spec.sampling import SamplingParams

        texts: list[str | None] = [None] * len(call.requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(call.requests):
            groups.setdefault((r.stop, r.max_new_tokens), []).append(i)
        sampling = SamplingParams(do_sample=call.temperature > 0, temperature=call.temperature or 1.0)
        for (stop, max_new), members in groups.items():
            config = DecodeConfig(max_new, sampling, self.method, self.num_draft_tokens, stop)
            level = Level(
                [self.encode(call.requests[i].prompt) for i in members],
                config,
                [call.seeds[i] for i in members],
                self.levels,
                call.component,
            )
            self.levels += 1
            t = time.perf_counter()
            results = self.engine.run(level, self.timeline)
            seconds = time.perf_counter() - t
            self._count(call.component, results, seconds)
            for i, prompt_ids, res in zip(members, level.prompts, results):
                texts[i] = cut_at_stop(self.decode(res.token_ids), stop)
                if self.record is not None:
                    self.record(
                        {
                            "component": call.component,
                            "temperature": call.temperature,
                            "prompt_ids": list(prompt_ids),
                            "token_ids": list(res.token_ids),
                        }
                    )
        return texts

    def _count(self, component: str, results, seconds: float) -> None:
        c = self.stats.setdefault(component, ComponentStats())
        c.levels += 1
        c.streams += len(results)
        c.seconds += seconds
        c.target_forwards += results[0].stats.target_forwards if results else 0
        for r in results:
            c.new_tokens += r.stats.new_tokens
            c.verify_steps += r.stats.verify_steps
            c.proposed += r.stats.proposed
            c.accepted += r.stats.accepted
