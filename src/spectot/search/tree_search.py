"""What REBASE, ETS, rStar and REST-MCTS share: their config, their result, the source of expansions.

A search algorithm (the consumer) gets its expansions from a ``ChildSource``: ``PlainSource`` runs
each one when asked (the plain algorithm); SPEX's ``explore.Explorer`` may have run it already,
speculatively. The algorithms are written once against this interface, so switching speculation off
gives exactly the plain algorithm's tree. ``stop`` is an optional early-termination test over the
answers found so far (SPEX's, in ``explore/termination.py``); the search layer only calls it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from spectot.backends.base import LivePriority
from spectot.search.ets import Embed
from spectot.search.expansion import PRIMARY, SPECULATIVE, Child, ChildKey, Expander
from spectot.search.rebase import AnswerGroup, weighted_vote
from spectot.tasks.base import Problem, Task

Algorithm = Literal["rebase", "ets", "rstar", "rest-mcts"]
DfsSpeculation = Literal["exact", "fold"]  # search/mcts.py: the sequential search kept, or the paper's folding
StopRule = Callable[[Sequence[AnswerGroup], int], bool]  # (vote groups, answers so far) -> stop now


@dataclass(frozen=True)
class TreeSearchConfig:
    algorithm: Algorithm = "rebase"
    budget: int = 8  # B: REBASE / ETS width per depth; MCTS: rollouts
    temperature: float = 0.2  # T_b of REBASE's softmax
    max_depth: int = 0  # 0: the task's depth
    c: float = 2.0  # UCT exploration constant (rStar)
    max_children: int = 3  # MCTS: children a node may get
    rest_children: int = 3  # REST-MCTS: children each step expands (the best by process reward is kept)
    rest_alpha: float = 0.5  # REST-MCTS*: weight of a rollout's best later process reward (uct.rollout_value)
    lambda_kv: float = 1.0  # ETS: weight of the KV cost (retained nodes)
    lambda_cov: float = 1.4  # ETS: weight of semantic coverage
    cluster_threshold: float = 0.6  # ETS: cosine distance at which step texts fall in one cluster
    embed: Embed | None = field(default=None, compare=False, repr=False)  # ETS: texts -> unit vectors (None: trigrams)
    dfs_speculation: DfsSpeculation = "exact"  # MCTS with SPEX: pre-run predicted rollouts, or fold extra ones in

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):  # NaN passed "<= 0" as a temperature
            raise ValueError(f"temperature must be a number > 0, got {self.temperature}")
        if not (math.isfinite(self.c) and self.c >= 0):
            raise ValueError(f"the UCT constant c must be a number >= 0, got {self.c}")
        if not (math.isfinite(self.rest_alpha) and 0 <= self.rest_alpha <= 1):
            raise ValueError(f"rest_alpha weighs two values and must lie in [0, 1], got {self.rest_alpha}")
        if not all(math.isfinite(w) and w >= 0 for w in (self.lambda_kv, self.lambda_cov)):
            raise ValueError(f"lambda_kv and lambda_cov must be numbers >= 0, got {self.lambda_kv}, {self.lambda_cov}")
        if self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0 (0 = the task's depth), got {self.max_depth}")
        if self.max_children < 1 or self.rest_children < 1:
            raise ValueError("max_children and rest_children must be >= 1")
        if self.cluster_threshold < 0:
            raise ValueError(f"cluster_threshold is a cosine distance and must be >= 0, got {self.cluster_threshold}")
        if self.dfs_speculation not in ("exact", "fold"):
            raise ValueError(f"dfs_speculation must be 'exact' or 'fold', got {self.dfs_speculation!r}")


@dataclass
class TreeSearchResult:
    problem: Problem
    answer: str
    groups: list[AnswerGroup]  # the weighted vote over the leaves, heaviest first
    leaves: list[Child]  # final states, in the order they were found
    expansions: list[Child] = field(default_factory=list)  # every expansion the search consumed
    stopped_early: bool = False

    def to_dict(self) -> dict:
        return {
            "id": self.problem.id,
            "answer": self.answer,
            "votes": [{"answer": g.answer, "weight": g.weight, "count": g.count} for g in self.groups],
            "leaves": [{"state": list(c.state), "reward": c.reward, "answer": c.answer} for c in self.leaves],
            "expansions": len(self.expansions),
            "stopped_early": self.stopped_early,
            "level_seconds": level_barrier_seconds(self.expansions),
            "critical_path_seconds": critical_path_seconds(self.expansions),
            "tree": expansion_tree(self.expansions),
        }


class ChildSource(Protocol):
    async def expand(self, key: ChildKey, priority: int | LivePriority = PRIMARY) -> Child: ...

    def ahead(self, key: ChildKey, priority: int = SPECULATIVE) -> asyncio.Future: ...

    async def level(self, keys: Sequence[ChildKey], rule=None, budget: int = 0) -> list[Child]: ...

    def retain(self, keep: Callable[[ChildKey], bool], running_only: bool = False) -> None: ...

    @property
    def speculating(self) -> bool: ...

    def spare(self, wanted: int, depth: int = 1, wake: Callable[[], None] | None = None) -> int: ...

    def start(self, work: Coroutine[Any, Any, Any], speculative: bool, units: int = 1) -> asyncio.Task: ...

    def reserve(self, work: Coroutine[Any, Any, Any], units: int) -> asyncio.Task: ...

    def promote(self, work: asyncio.Task | None = None) -> None: ...

    def used(self, expansions: Sequence[Child]) -> None: ...

    def dropped(self, expansions: Sequence[Child], failed: bool = False) -> None: ...

    async def close(self) -> None: ...


@dataclass
class PlainSource:
    """Every expansion run when the search asks for it; nothing speculative."""

    expander: Expander

    async def expand(self, key: ChildKey, priority: int | LivePriority = PRIMARY) -> Child:
        return await self.expander.expand(key, priority)

    def ahead(self, key: ChildKey, priority: int = SPECULATIVE) -> asyncio.Future:
        return asyncio.ensure_future(self.expander.expand(key, priority))

    async def level(self, keys: Sequence[ChildKey], rule=None, budget: int = 0) -> list[Child]:
        return await gather_or_cancel(self.expand(k) for k in keys)

    def retain(self, keep: Callable[[ChildKey], bool], running_only: bool = False) -> None:
        pass

    @property
    def speculating(self) -> bool:
        return False

    def spare(self, wanted: int, depth: int = 1, wake: Callable[[], None] | None = None) -> int:
        return 0

    def start(self, work: Coroutine[Any, Any, Any], speculative: bool, units: int = 1) -> asyncio.Task:
        return asyncio.create_task(work)

    def reserve(self, work: Coroutine[Any, Any, Any], units: int) -> asyncio.Task:
        return asyncio.create_task(work)

    def promote(self, work: asyncio.Task | None = None) -> None:
        pass

    def used(self, expansions: Sequence[Child]) -> None:
        pass

    def dropped(self, expansions: Sequence[Child], failed: bool = False) -> None:
        pass

    async def close(self) -> None:
        pass


async def gather_or_cancel(work) -> list:
    """The results of ``work`` (awaitables), run at once; on the first failure the rest are cancelled, and
    awaited, before it is raised: a query that fails alone (a prompt past the context) leaves no sibling
    expansion running on unowned."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def level_barrier_seconds(expansions: Sequence[Child]) -> float:
    """sum_d max_{n at depth d} t(n): a BFS's time when each level starts together and waits for its
    slowest expansion (the plain algorithm at a reward barrier)."""
    slowest: dict[int, float] = {}
    for c in expansions:
        depth = len(c.key.parent)
        slowest[depth] = max(slowest.get(depth, 0.0), c.seconds)
    return sum(slowest.values())


def critical_path_seconds(expansions: Sequence[Child]) -> float:
    """max over nodes of sum_{a on root..n} t(a): the tree's time when every expansion starts the moment
    its parent's ends (perfect speculation, free concurrency). ``level_barrier_seconds / this`` is the
    most any speculation can speed up the same tree. Worked example: depth 0 takes [3, 1] s, the child of
    the 1 s node takes 2 s, the child of the 3 s node 1 s: barrier 3 + 2 = 5 s, critical path
    max(3 + 1, 1 + 2) = 4 s, ceiling 1.25x."""
    finished_at: dict[tuple, float] = {(): 0.0}  # node -> when its expansion ends
    for c in sorted(expansions, key=lambda c: len(c.state)):  # parents before children
        finished_at[c.node] = finished_at.get(c.key.at, 0.0) + c.seconds
    return max(finished_at.values())


def expansion_tree(expansions: Sequence[Child]) -> list[tuple[int, int, float]]:
    """(parent index or -1 for a child of the root, tokens, seconds) per expansion, parents first: the
    shape ``explore/bound.py`` replays on the machine's throughput curve."""
    nodes = sorted(expansions, key=lambda c: len(c.state))
    index = {c.node: i for i, c in enumerate(nodes)}
    return [(index.get(c.key.at, -1), c.tokens, c.seconds) for c in nodes]


def root_child() -> Child:
    """The root as a node: the empty state, full reward (it is always kept)."""
    return Child(ChildKey((), -1), (), "", 1.0, False, "", 0, 0.0)


def vote(task: Task, leaves: Sequence[Child]) -> list[AnswerGroup]:
    """Weighted majority vote over the leaves' answers (weights = rewards), grouped by the task's
    answer equivalence (numbers for GSM8K, the MATH-500 grader's)."""
    return weighted_vote([c.answer or None for c in leaves], [c.reward for c in leaves], task.same_answer)


def stops(stop: StopRule | None, task: Task, leaves: Sequence[Child]) -> bool:
    """Whether ``stop`` ends the search over these leaves. The answers it counts are the voting leaves' (a leaf
    that ended without an answer, e.g. at the depth limit, casts no vote): ['7', None, None, None] is one answer,
    so a lone group cannot settle at t = 4 on leaves that say nothing."""
    if stop is None or not leaves:
        return False
    groups = vote(task, leaves)
    return stop(groups, sum(group.count for group in groups))


def read_open(task: Task, problem: Problem, leaves: list[Child]) -> list[Child]:
    """The leaves to vote on: as they are, or, where none answered (the depth limit came first everywhere), each
    open one with the answer the task reads in its steps."""
    if any(c.answer for c in leaves):
        return leaves
    return [replace(c, answer=task.final_answer(problem, c.state)) if c.state and not c.final else c for c in leaves]


def result_of(task: Task, problem: Problem, leaves: list[Child], expansions: list[Child], stopped: bool):
    groups = vote(task, leaves)
    return TreeSearchResult(problem, groups[0].answer if groups else "", groups, leaves, expansions, stopped)
