"""One expansion — a new child of a search node, generated and rewarded — over an async backend.

REBASE, ETS, rStar and REST-MCTS all grow their trees one *expansion* at a time: the Thought
Generator writes the next step after a state (one completion), and a reward scores the new state.
An expansion is named by its ``ChildKey`` — the parent state, the parent's place in the tree and the
child's index among its siblings — and its sampling seed is a pure function of that key and the run's
seed, so the same child comes out whether the search asks for it or SPEX speculated it earlier, on spectot's
engines whatever the batch (their seeded sampling is batch-invariant): speculation changes when work happens,
never what it produces. A server whose seeded sampling depends on the batch (vLLM's) keeps the distribution but
not the very text, so there a run with SPEX may differ from one without. The place (``Node``: the
child indices from the root) keeps two nodes whose steps read alike apart: each samples its own children,
as the plain algorithm does (keyed by text alone, they drew the same children, and SPEX's cache ran the
duplicates once where the plain search ran them twice).

Rewards (``RewardKind``):
    self_eval  the task's evaluator prompt, greedy, scaled from the task's value range to [0, 1]
    logprob    the policy's own confidence: exp(mean token log-probability of the step)
    a callable ``(problem, state) -> float`` in [0, 1]: a pluggable reward model
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

from spectot.backends.base import AsyncBackend, Completion, CompletionRequest, LivePriority
from spectot.spec.decoding import stream_seeds
from spectot.tasks.base import Problem, State, StepRequest, Task

RewardKind = Literal["self_eval", "logprob"]
RewardModel = Callable[[Problem, State], float]
# backend priorities, lowest first: primary-branch work, then the speculative work the search will most likely
# ask for next (DFS exact: the likeliest pre-run), then the rest of the speculative work
PRIMARY, NEXT, SPECULATIVE = 0, 1, 2


Node = tuple[int, ...]  # a place in the search tree: the child indices from the root (the root: ())


@dataclass(frozen=True)
class ChildKey:
    parent: State
    index: int  # the child's rank among its siblings: child i of a parent is always the same sample
    at: Node = ()  # the parent's place in the tree

    @property
    def node(self) -> Node:
        """The child's place in the tree."""
        return self.at + (self.index,)


@dataclass(frozen=True)
class Child:
    key: ChildKey
    state: State  # parent + (step,)
    text: str  # the generator's raw output
    reward: float  # in [0, 1]
    final: bool
    answer: str  # the task's final answer of `state` ('' when it gives none)
    tokens: int  # tokens generated for this expansion (step + reward)
    seconds: float

    @property
    def node(self) -> Node:
        """Its place in the tree (the root's: ())."""
        return self.key.node if self.key.index >= 0 else ()

    @classmethod
    def make_dummy(
        cls, parent: State = (), index: int = 0, reward: float = 0.5, final: bool = False, answer="", at: Node = ()
    ):
        step = f"step {len(parent)}.{index}"
        return cls(ChildKey(parent, index, at), parent + (step,), step, reward, final, answer, 10, 0.0)


@dataclass(frozen=True)
class ExpansionSampling:
    """How an expansion samples: its thought at (temperature, top_p), its self-evaluation at eval_temperature."""

    temperature: float = 1.0  # thoughts are sampled
    top_p: float = 1.0  # 1 = off
    eval_temperature: float = 0.0  # evaluations are greedy

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.eval_temperature >= 0 and 0 < self.top_p <= 1):
            raise ValueError(f"temperatures must be >= 0 and top_p in (0, 1], got {self}")


@dataclass
class ExpansionCounters:
    expansions: int = 0
    tokens: int = 0  # generated: thoughts as they finish, rewards' when theirs do (cancelled expansions' too)
    requests: int = 0
    cancelled_tokens: int = 0  # the thoughts of expansions cancelled during their reward (a thought cut mid-way:
    #                            the backend does not say how far it got, so it counts nothing)


def logprob_reward(out: Completion) -> float:
    """The policy's own confidence in a step: exp(mean token log-prob); 0 for an empty step. A step of tokens
    without log-probs is an error (a backend that does not return them would otherwise score every step 1)."""
    if out.logprobs:
        return math.exp(out.mean_logprob)
    if out.completion_tokens == 0:
        return 0.0
    raise ValueError("--reward logprob needs the backend's token log-probs; this completion came without them")


@dataclass
class Expander:
    """Expansions of one problem: ``expand(key)`` runs the generation and the reward, in that order."""

    task: Task
    problem: Problem
    backend: AsyncBackend
    reward: RewardKind | RewardModel = "self_eval"
    seed: int = 0
    sampling: ExpansionSampling = field(default_factory=ExpansionSampling)
    counters: ExpansionCounters = field(default_factory=ExpansionCounters)

    async def expand(self, key: ChildKey, priority: int | LivePriority = PRIMARY) -> Child:
        """The generation, then its reward; a ``LivePriority`` lets the caller re-rank both while they run."""
        t = time.perf_counter()
        step_request = self.task.thought(self.problem, key.parent)
        [seed] = stream_seeds(self.seed, "TG", self.problem.id, key.parent, key.at, key.index, n=1)
        sampling = self.sampling
        out = await self._complete(
            step_request, sampling.temperature, seed, priority, sampling.top_p, logprobs=self.reward == "logprob"
        )
        self.counters.tokens += out.completion_tokens
        step = self.task.parse_thought(self.problem, key.parent, out.text)
        state = key.parent + (step,)
        try:
            reward, reward_tokens = await self._reward(state, key.node, out, priority)
        except asyncio.CancelledError:  # its thought was generated for nothing
            self.counters.cancelled_tokens += out.completion_tokens
            raise
        self.counters.tokens += reward_tokens
        final = self.task.is_final(self.problem, state)
        answer = self.task.final_answer(self.problem, state) if final else ""
        tokens = out.completion_tokens + reward_tokens
        self.counters.expansions += 1
        return Child(key, state, out.text, reward, final, answer, tokens, time.perf_counter() - t)

    async def _reward(
        self, state: State, node: Node, out: Completion, priority: int | LivePriority
    ) -> tuple[float, int]:
        if self.reward == "logprob":
            return logprob_reward(out), 0
        if callable(self.reward):
            value = float(self.reward(self.problem, state))
            # a NaN would win votes and UCT choices in silence; outside [0, 1] the vote weights break (a negative
            # one lets SPEX's termination rule settle a tie)
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"the reward model returned {value} for a state of problem {self.problem.id}: rewards lie in [0, 1]"
                )
            return value, 0
        [seed] = stream_seeds(self.seed, "SE", self.problem.id, state, node, n=1)
        judged = await self._complete(
            self.task.value(self.problem, state), self.sampling.eval_temperature, seed, priority
        )
        low, high = self.task.value_range
        score = (self.task.parse_value(judged.text) - low) / (high - low)
        return min(1.0, max(0.0, score)), judged.completion_tokens

    async def _complete(
        self,
        step: StepRequest,
        temperature: float,
        seed: int,
        priority: int | LivePriority,
        top_p: float = 1.0,
        logprobs: bool = False,
    ) -> Completion:
        self.counters.requests += 1
        live = priority if isinstance(priority, LivePriority) else None
        request = CompletionRequest(
            step.prompt, step.max_new_tokens, temperature, top_p, step.stop, seed, logprobs,
            priority=priority if live is None else live.value, chat=self.task.chat, live_priority=live,
        )  # fmt: skip
        return await self.backend.complete(request)

    def counters_dict(self) -> dict:
        return asdict(self.counters)
