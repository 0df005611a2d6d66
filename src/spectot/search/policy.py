"""The policy a search runs: a Thought Generator G and a State Evaluator E over a backend.

A *backend* turns a batch of ``StepRequest`` prompts into texts; the search hands it a whole level
at once, so the backend's engine can schedule the n generations together (SEED). ``LocalBackend``
runs spectot's engine on a local target; a black-box backend (an OpenAI-compatible server) fits the
same two-method interface. Per-component counters (TG / SE) feed the solve summary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from spectot.spec.decoding import DecodeConfig, cut_at_stop, decode_after, stream_seeds
from spectot.tasks.base import StepRequest


@dataclass
class ComponentStats:
    """Totals over every level one component (TG or SE) ran."""

    levels: int = 0
    streams: int = 0
    new_tokens: int = 0
    verify_steps: int = 0  # per-stream target verifications (the prefill's first token not counted)
    # forwards of the target (a batched forward counts once; a continuous engine's: every step it ran while the
    # level did, steps it shared with other queries in flight included, prefill forwards not)
    target_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens per verification step of a stream, the bonus token included (``DecodeStats``'
        ``mean_acceptance_length``: the prefill's first token is not a step): exactly 1.0 for AR."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_step": self.tokens_per_step, "acceptance_rate": self.acceptance_rate}


@dataclass(frozen=True)
class GenerationCall:
    """One level's worth of generation: prompts, their sampling settings and random seeds."""

    requests: Sequence[StepRequest]
    temperature: float  # 0 = greedy
    seeds: Sequence[int]
    component: str  # "TG" or "SE"
    top_p: float = 1.0  # nucleus mass (1 = off)


class Backend(Protocol):
    def generate(self, call: GenerationCall) -> list[str]: ...


FollowRequest = Callable[[int, str], StepRequest]  # (request i, its text) -> the request that follows it


@dataclass
class Policy:
    """G and E: what the search asks for, with the sampling settings of each."""

    backend: Backend
    seed: int = 0
    thought_temperature: float = 1.0  # SEED / ToT sample thoughts at temperature 1
    eval_temperature: float = 0.0
    thought_top_p: float = 1.0

    def generate(self, requests: Sequence[StepRequest], *labels: object) -> list[str]:
        return self._call(requests, "TG", labels)

    def evaluate(self, requests: Sequence[StepRequest], *labels: object) -> list[str]:
        return self._call(requests, "SE", labels)

    def generate_then_evaluate(
        self, requests: Sequence[StepRequest], evaluation: FollowRequest, *labels: object
    ) -> tuple[list[str], list[str]]:
        """G's texts and, for each, E's text on ``evaluation(i, text)``. A backend that ``chains`` them
        (``generate_chained``) starts each evaluation as soon as its text is done; the seeds, and so
        the texts, are those of ``generate`` then ``evaluate``."""
        if not requests:
            return [], []
        if not getattr(self.backend, "chains", False):
            texts = self.generate(requests, *labels)
            return texts, self.evaluate([evaluation(i, t) for i, t in enumerate(texts)], *labels)
        first = self._level(requests, "TG", labels, len(requests))
        then = self._level((), "SE", labels, len(requests))  # requests made as texts end
        return self.backend.generate_chained(first, then, evaluation)

    def _call(self, requests: Sequence[StepRequest], component: str, labels) -> list[str]:
        if not requests:
            return []
        return self.backend.generate(self._level(requests, component, labels, len(requests)))

    def _level(self, requests, component: str, labels, n: int) -> GenerationCall:
        """One level's call: G's or E's sampling, n stream seeds (a pure function of the run's seed and the
        level's labels)."""
        seeds = stream_seeds(self.seed, component, *labels, n=n)
        if component == "TG":
            return GenerationCall(requests, self.thought_temperature, seeds, component, self.thought_top_p)
        return GenerationCall(requests, self.eval_temperature, seeds, component)


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
    # searches of several problems may share the backend from their own threads (``run_solve(in_flight=)``)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def chains(self) -> bool:
        """Whether the engine runs a request's follow-up as soon as the request ends (``generate_chained``)."""
        return hasattr(self.engine, "run_chained")

    def generate_chained(
        self, first: GenerationCall, then: GenerationCall, follow: FollowRequest
    ) -> tuple[list[str], list[str]]:
        """``first``'s texts and, for each, the text of ``follow(i, text)`` sampled as ``then`` says
        (``then`` brings the seeds), each follow-up started as soon as its text is done."""
        from spectot.schedulers.base import Level

        [(stop, max_new)] = {(r.stop, r.max_new_tokens) for r in first.requests}  # a search level shares them
        config = self._config(first, stop, max_new)
        level = Level(
            [self.encode(r.prompt) for r in first.requests], config, first.seeds, self._next_level(), first.component
        )
        texts: list[str] = [""] * len(first.requests)
        asked: list[StepRequest | None] = [None] * len(first.requests)

        def follow_up(i: int, result) -> tuple[list[int], DecodeConfig, int]:  # on this thread, as streams end
            texts[i] = cut_at_stop(self._text(result), stop)
            asked[i] = r = follow(i, texts[i])
            return self.encode(r.prompt), self._config(then, r.stop, r.max_new_tokens), then.seeds[i]

        run = self.engine.run_chained(level, follow_up)
        self._count(first.component, run.first, run.first_seconds, run.first_forwards)
        self._count(then.component, run.then, run.seconds - run.first_seconds, run.forwards - run.first_forwards)
        self._record(first, run.first)
        self._record(then, run.then)
        return texts, [cut_at_stop(self._text(res), r.stop) for res, r in zip(run.then, asked)]

    def _config(self, call: GenerationCall, stop: tuple[str, ...], max_new: int) -> DecodeConfig:
        from spectot.spec.sampling import SamplingParams

        sampling = SamplingParams(do_sample=call.temperature > 0, temperature=call.temperature or 1.0, top_p=call.top_p)
        return DecodeConfig(max_new, sampling, self.method, self.num_draft_tokens, stop)

    def generate(self, call: GenerationCall) -> list[str]:
        from spectot.schedulers.base import Level

        texts: list[str | None] = [None] * len(call.requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(call.requests):
            groups.setdefault((r.stop, r.max_new_tokens), []).append(i)
        for (stop, max_new), members in groups.items():
            level = Level(
                [self.encode(call.requests[i].prompt) for i in members],
                self._config(call, stop, max_new),
                [call.seeds[i] for i in members],
                self._next_level(),
                call.component,
            )
            t = time.perf_counter()
            steps = _engine_steps(self.engine)
            results = self.engine.run(level, self.timeline)
            seconds = time.perf_counter() - t
            if steps is not None:  # a long-lived engine's session counts every forward since it started
                forwards = _engine_steps(self.engine) - steps
            else:
                forwards = results[0].stats.target_forwards if results else 0
            self._count(call.component, results, seconds, forwards)
            self._record(call, results)
            for i, res in zip(members, results):
                texts[i] = cut_at_stop(self._text(res), stop)
        return texts

    def _text(self, result) -> str:
        """A stream's completion as it reads after its prompt (``decode_after``: a SentencePiece text keeps its
        leading space)."""
        return decode_after(self.decode, result.prompt_ids, result.token_ids)

    def _next_level(self) -> int:
        with self._lock:
            self.levels += 1
            return self.levels - 1

    def _record(self, call: GenerationCall, results) -> None:
        if self.record is None:
            return
        with self._lock:
            for res in results:
                self.record(
                    {
                        "component": call.component,
                        "temperature": call.temperature,
                        "top_p": call.top_p,
                        "prompt_ids": list(res.prompt_ids),
                        "token_ids": list(res.token_ids),
                    }
                )

    def _count(self, component: str, results, seconds: float, forwards: int) -> None:
        with self._lock:
            c = self.stats.setdefault(component, ComponentStats())
            c.levels += 1
            c.streams += len(results)
            c.seconds += seconds
            c.target_forwards += forwards
            for r in results:
                c.new_tokens += r.stats.new_tokens
                c.verify_steps += r.stats.verify_steps
                c.proposed += r.stats.proposed
                c.accepted += r.stats.accepted


def _engine_steps(engine) -> int | None:
    """The target forwards (prefills too) a continuous engine has run so far, as ``run_chained`` counts; else None."""
    inner = getattr(engine, "engine", None)
    counters = getattr(inner, "counters", None)
    return None if counters is None else counters.target_forwards
