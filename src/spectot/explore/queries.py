"""Many queries in flight: each runs its tree search; with SPEX they share one speculation budget.

``run_queries`` keeps ``in_flight`` queries running at once over one async backend (the local engine
batches all their requests into shared forwards; a remote server does its own batching). Each query
gets an ``Explorer`` (SPEX on) or a ``PlainSource`` (off) and, optionally, SPEX's early-termination
rule; it yields one ``QueryRecord`` per finished query, in finishing order. A query whose request is refused
for itself (a prompt past the context: ``is_refusal``) ends with its record saying why, score 0, and the others go
on; any other failure ends them all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from spectot.backends.base import AsyncBackend, is_refusal
from spectot.explore.explorer import Explorer, SharedBudget, SpecCounters
from spectot.explore.termination import settled
from spectot.search.bfs import reward_balanced_search
from spectot.search.expansion import Expander, ExpansionSampling, RewardKind
from spectot.search.mcts import mcts_search
from spectot.search.tree_search import PlainSource, TreeSearchConfig
from spectot.tasks.base import Problem, Task

Exploration = Literal["none", "spex"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExploreConfig:
    explore: Exploration = "none"
    k_total: int = 8  # expansions in flight over all queries, primary + speculative (`bench spex` measures it)
    lookahead: int = 2  # BFS: layers expanded ahead
    retract: bool = True  # BFS: cancel running speculation the latest widths no longer predict
    tau: float = 1.0  # softmax temperature of the inter-query allocation
    wake_up: bool = False  # a refused query asks again when any query's expansion ends (``SharedBudget.grant``)
    early_stop: bool = False
    min_answers: int = 4  # t: answers needed before the vote may settle
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.k_total < 0 or self.lookahead < 0 or self.min_answers < 1:
            raise ValueError("k_total and lookahead must be >= 0 and min_answers >= 1")
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):  # NaN never settles, a negative one settles ties
            raise ValueError(f"alpha must be a finite number >= 0, got {self.alpha}")


@dataclass
class QueryRecord:
    id: str
    answer: str
    gold: str
    score: float  # the task's grade of the answer
    seconds: float
    expansions: int  # expansions the search consumed
    tokens: int  # tokens generated for this query (speculative ones included)
    requests: int
    stopped_early: bool
    spec: dict = field(default_factory=dict)  # SpecCounters.to_dict()
    result: dict = field(default_factory=dict)
    error: str = ""  # why the query failed (a request refused for itself); "" when its search ended

    def to_dict(self) -> dict:
        return asdict(self)


async def run_queries(
    task: Task,
    problems: Sequence[Problem],
    backend: AsyncBackend,
    search: TreeSearchConfig,
    explore: ExploreConfig,
    in_flight: int = 1,
    reward: RewardKind = "self_eval",
    seed: int = 0,
    sampling: ExpansionSampling | None = None,
) -> AsyncIterator[QueryRecord]:
    if in_flight < 1:
        raise ValueError(f"queries in flight must be >= 1, got {in_flight}")
    budget = SharedBudget(explore.k_total, explore.tau, wake_up=explore.wake_up) if explore.explore == "spex" else None
    stop = None
    if explore.early_stop:

        def stop(groups, n):
            return settled(groups, n, explore.min_answers, explore.alpha)

    gate = asyncio.Semaphore(in_flight)

    async def one(q: int, problem: Problem) -> QueryRecord:
        async with gate:
            t = time.perf_counter()
            expander = Expander(task, problem, backend, reward, seed, sampling or ExpansionSampling())
            source = (
                Explorer(expander, budget, q, explore.lookahead, explore.retract)
                if budget is not None
                else PlainSource(expander)
            )
            run = mcts_search if search.algorithm in ("rstar", "rest-mcts") else reward_balanced_search
            try:
                result = await run(task, problem, source, search, stop)
            except Exception as error:
                if not is_refusal(error):  # it ends the run: a bad input names its problem
                    if isinstance(error, ValueError):
                        raise ValueError(f"problem {problem.id}: {error}") from error
                    raise
                log.warning("problem %s failed: %s", problem.id, error)
                spent = expander.counters
                return QueryRecord(
                    problem.id,
                    answer="",
                    gold=str(problem.answer),
                    score=0.0,
                    seconds=time.perf_counter() - t,
                    expansions=0,
                    tokens=spent.tokens,
                    requests=spent.requests,
                    stopped_early=False,
                    error=str(error),
                )
            finally:
                await source.close()
            counters = source.counters if isinstance(source, Explorer) else SpecCounters()
            return QueryRecord(
                problem.id,
                result.answer,
                str(problem.answer),
                task.grade(problem, result.answer),
                time.perf_counter() - t,
                len(result.expansions),
                expander.counters.tokens,
                expander.counters.requests,
                result.stopped_early,
                counters.to_dict(),
                result.to_dict(),
            )

    tasks = [asyncio.create_task(one(q, p)) for q, p in enumerate(problems)]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
