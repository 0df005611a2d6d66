"""SPEX's producer/consumer execution for one query: expansions as tasks, some of them speculative.

The *consumer* is the search algorithm (``search/bfs.py``, ``search/mcts.py``): it asks for the
expansions it needs (``expand``, ``level``) and appends their results to its tree. The *producers*
are asyncio tasks, one per expansion, each a generation plus its reward on the backend. Without
speculation the explorer is a thin pass-through, so the search is exactly the plain algorithm.

With speculation, while the consumer waits at a reward barrier the explorer starts expansions the
search will probably ask for next:
    BFS  a level child that finished early is expanded ahead with the algorithm's own width rule over
         its finished siblings and, for each sibling still running, a stand-in scored at their mean
         reward (``expected_widths``), ``lookahead`` layers deep (a deeper layer's widths: over its level's
         finished speculated nodes, the rest of the level's ``budget`` nodes stood in alike); with
         ``retract``, a running speculated child is cancelled once a later finish lowers its parent's
         predicted width below its index (a finished one is kept for a later prediction);
    DFS  the search itself asks for ``spare()`` extra rollouts: pre-runs of its predicted next
         selections made of ``ahead`` expansions (exact), or rollouts it folds in (the paper's).
Speculative work runs at backend priority 2, or 1 for the likeliest pre-run (primary work, 0, is admitted
first; a backend may draft for the lower ones only, ``--sd-requests``), and only within the
query's share of the global budget (``SharedBudget``); primary work never waits for budget. A
speculated expansion the search later asks for is a *hit*: awaited, not re-run, and what is left of it
raised to primary priority (``LivePriority``: the local engine re-ranks it and, under ``--sd-requests``,
drafts for it from then on). The subtrees the search moves away from are cancelled at once and their
budget released.

Vocabulary of the counters: speculated = speculative expansions started; hits = those the search
used; cancelled = stopped before finishing; wasted_tokens = tokens of finished speculative
expansions never used, and the thoughts of expansions cancelled during their evaluation (a generation cut
mid-way counts nothing: the backend does not say how far it got); saving rate = expansions the search used
that had run speculatively / expansions the search used (a BFS hit is one expansion; a DFS rollout folded in
brings the steps it ran speculatively).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spectot.backends.base import LivePriority
from spectot.explore.budget import allocate
from spectot.search.expansion import PRIMARY, SPECULATIVE, Child, ChildKey, Expander, Node
from spectot.search.tree_search import gather_or_cancel

WidthRule = Callable[[Sequence[Child], int], list[int]]  # (finished siblings, budget) -> children of each


@dataclass
class SpecCounters:
    expansions_used: int = 0  # expansions the search consumed (primary ones and speculative ones it used)
    saved_expansions: int = 0  # of those, the ones that had run speculatively
    speculated: int = 0
    hits: int = 0
    cancelled: int = 0
    failed: int = 0  # speculative expansions and fold rollouts that failed (a timeout, an aborted request): misses
    wasted_tokens: int = 0
    used_tokens: int = 0
    budget_peak: int = 0  # most speculative expansions in flight at once
    speculative_seconds: float = 0.0  # unit-seconds of speculative work held (cancelled included): run time x units

    @property
    def hit_rate(self) -> float:
        return self.hits / self.speculated if self.speculated else 0.0

    @property
    def saving_rate(self) -> float:
        return self.saved_expansions / self.expansions_used if self.expansions_used else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "saving_rate": self.saving_rate}


@dataclass
class SharedBudget:
    """The global cap of expansions in flight, shared by every query (SPEX's inter-query budget).

    k_total bounds primary and speculative expansions together: primary work never waits for it, and
    speculation only gets what primary work leaves free, k_spec = k_total - primary in flight, split
    between the queries asking with ``allocate``'s k_q. So speculation fills the machine's idle
    concurrency (a level's stragglers, queries between levels) and never crowds the work the search
    is waiting for past the point where throughput stops rising.
    """

    k_total: int
    tau: float = 1.0
    reusable_weight: float = 1.0  # S_w: target weights are reused by every expansion alike
    wake_up: bool = False  # keep a refused query's ``wake`` (off: it asks again only when its own work ends)
    kv_reuse: dict[int, float] = field(default_factory=dict)  # S_KV(q) at q's last ask; its keys: queries present
    in_flight: dict[int, int] = field(default_factory=dict)  # speculative expansions running, per query
    primary: int = 0  # primary expansions running, all queries
    hits: dict[int, int] = field(default_factory=dict)
    speculated: dict[int, int] = field(default_factory=dict)
    waiting: dict[int, Callable[[], None]] = field(default_factory=dict)  # refused queries' wake-ups (``grant``)

    def grant(self, query: int, wanted: int, kv_reuse: float, wake: Callable[[], None] | None = None) -> int:
        """How many more speculative expansions ``query`` may start now (it starts them at once: ``started``).
        C_q counts a query's running speculation, plus what it asks for now if it is the one asking. What a
        query asked for and was not granted is not held for it (a reservation kept for it, as this once did,
        left units idle that another query asked for: one waiting at its level barrier took the softmax share
        of a query asking for 3); instead, with ``wake_up`` on, ``wake`` (if given) is called once when units next free
        up (any query's expansion ending), so the query asks again at once rather than when its own work next ends.
        Off by default: rStar at 4 queries in flight on a 2-core CPU speculated more with it (1,095 against 1,014
        expansions, hit rate 0.64 against 0.70) and ran no faster (1.13x against 1.17x plain, one run)."""
        self.kv_reuse[query] = kv_reuse
        queries = list(self.kv_reuse)
        capacity = [self.in_flight.get(q, 0) + (wanted if q == query else 0) for q in queries]
        # P_q: the query's hit rate so far with a uniform prior (Laplace), so a new query is not starved
        hit_rate = [(self.hits.get(q, 0) + 1) / (self.speculated.get(q, 0) + 2) for q in queries]
        k_spec = max(0, self.k_total - self.primary)
        shares = allocate(
            k_spec, capacity, hit_rate, self.reusable_weight, [self.kv_reuse[q] for q in queries], self.tau
        )
        free = k_spec - sum(self.in_flight.values())
        mine = shares[queries.index(query)] - self.in_flight.get(query, 0)
        granted = max(0, min(mine, free, wanted))
        if granted < wanted and wake is not None and self.wake_up:
            self.waiting[query] = wake  # the latest ask stands for the query's earlier ones
        return granted

    def started(self, query: int, units: int = 1) -> None:
        self.in_flight[query] = self.in_flight.get(query, 0) + units

    def finished(self, query: int, units: int = 1) -> None:
        self.in_flight[query] -= units
        self._freed()

    def primary_finished(self) -> None:
        self.primary -= 1
        self._freed()

    def _freed(self) -> None:
        """Units freed up: every query refused earlier asks again (in the order they asked; ``allocate`` splits)."""
        waiting, self.waiting = self.waiting, {}
        for wake in waiting.values():
            wake()

    def tried(self, query: int) -> None:
        """One more speculative unit (an expansion, or a folded-in rollout) that may become a hit."""
        self.speculated[query] = self.speculated.get(query, 0) + 1

    def hit(self, query: int) -> None:
        self.hits[query] = self.hits.get(query, 0) + 1

    def leave(self, query: int) -> None:
        """The query is done: it asks for nothing more (its speculation was cancelled and gave its units back)."""
        self.kv_reuse.pop(query, None)
        self.waiting.pop(query, None)
        if not self.in_flight.get(query):
            self.in_flight.pop(query, None)


@dataclass
class _Job:
    task: asyncio.Task
    speculative: bool
    used: bool = False
    priority: LivePriority | None = None  # a speculative job's: the search taking it over makes it primary
    holds: bool = False  # it holds a unit of the query's budget itself (not a step of a pre-run, which holds them)


class Explorer:
    def __init__(
        self,
        expander: Expander,
        budget: SharedBudget | None = None,  # None: no speculation (the plain algorithm)
        query: int = 0,
        lookahead: int = 2,  # BFS: layers expanded ahead of the level being waited for
        retract: bool = True,  # BFS: cancel a running speculated child once the widths no longer predict it
    ) -> None:
        self.expander, self.budget, self.query, self.lookahead = expander, budget, query, lookahead
        self.retract = retract
        self.counters = SpecCounters()
        self._jobs: dict[ChildKey, _Job] = {}
        self._holding: dict[asyncio.Task, Callable[[], None]] = {}  # speculative work's budget, given back once
        self._closed = False  # the search is done: a speculative expansion finishing late starts nothing more
        self._asks: dict[int, Callable[[], None]] = {}  # BFS: per depth, the speculation the budget refused
        self._keep: Callable[[ChildKey], bool] = lambda key: True  # the search's latest ``retain``
        self._widths: dict[Node, int] = {}  # BFS: each parent's latest predicted width, since the search's retain

    @property
    def speculating(self) -> bool:
        return self.budget is not None and self.budget.k_total > 0

    # -- what the consumer (the search) calls ------------------------------------------------------
    async def expand(self, key: ChildKey, priority: int | LivePriority = PRIMARY) -> Child:
        """The child at ``key``: a speculated one if it exists (a hit), else a primary expansion.
        A speculative rollout's own steps (DFS fold, priority above ``PRIMARY``) run as they are: the rollout
        as a whole is what is speculated (``start``)."""
        if self._closed:  # a search's leftover task asking after the search ended: nobody would cancel its work
            raise RuntimeError(f"the explorer of query {self.query} is closed: its search is over")
        if priority != PRIMARY:
            return await self.expander.expand(key, priority)
        job = self._jobs.get(key)
        if job is None or job.task.cancelled():
            job = self._jobs[key] = _Job(self._primary(key), False)
        hit = job.speculative and not job.used
        if hit:
            if job.priority is not None:  # what is left of it (its generation, its reward) runs as primary work
                job.priority.set(PRIMARY)
            if not job.holds and not job.task.done():  # a pre-run's step: primary work from now on, counted so
                self._count_primary(job.task)
        job.used = True
        try:
            child = await self._result(key, job)
        except Exception:  # failed before or while awaited
            if not job.speculative:
                raise  # primary work failed: the search fails, as the plain one would
            self.counters.failed += 1  # a speculative failure is a miss: the search runs the expansion itself
            job = self._jobs[key] = _Job(self._primary(key), False, used=True)
            child, hit = await self._result(key, job), False
        if hit:
            self.counters.hits += 1
            self.counters.saved_expansions += 1
            if self.budget is not None:
                self.budget.hit(self.query)
        self._consumed([child])  # every use: two frontier nodes of one state are two expansions of the plain search
        return child

    def ahead(self, key: ChildKey, priority: int = SPECULATIVE) -> asyncio.Future:
        """The child at ``key``, pre-run speculatively at ``priority`` if nobody ran it yet (DFS exact: a step of
        a predicted rollout); the search's own ``expand(key)`` later takes it over as a hit. It holds no budget
        of its own: the pre-run it belongs to does (``reserve``), so the budget never lapses between its steps."""
        job = self._jobs.get(key)
        task = self._launch(key, False, priority) if job is None or job.task.cancelled() else job.task
        return asyncio.shield(task)

    async def level(self, keys: Sequence[ChildKey], rule: WidthRule | None = None, budget: int = 0) -> list[Child]:
        """Every child of a BFS level; with speculation, each finished non-final child is expanded
        ahead (``rule`` over its finished siblings, ``budget`` the level's remaining width)."""
        if not self.speculating or rule is None:
            return await gather_or_cancel(self.expand(k) for k in keys)
        tasks = [asyncio.ensure_future(self.expand(k)) for k in keys]
        finished: list[Child] = []
        place = {key: i for i, key in enumerate(keys)}
        for next_done in asyncio.as_completed(tasks):
            child = await next_done
            # in the search's key order, not finishing order: the width rule breaks reward ties by position
            # (REBASE gives the earlier of tied siblings the extra child), so the last prediction is exact
            finished = sorted([*finished, child], key=lambda c: place[c.key])
            self._speculate_children(finished, len(tasks) - len(finished), rule, budget, self.lookahead)
        return [t.result() for t in tasks]

    def spare(self, wanted: int, depth: int = 1, wake: Callable[[], None] | None = None) -> int:
        """How many speculative expansions the query may start now (DFS: extra rollouts); if fewer than
        ``wanted``, ``wake`` is called once when units free up (the search asks again then)."""
        if not self.speculating or wanted <= 0 or self._closed:
            return 0
        return self.budget.grant(self.query, wanted, depth / (depth + 1), wake)

    def start(self, work: Coroutine[Any, Any, Any], speculative: bool, units: int = 1) -> asyncio.Task:
        """Run a unit of the search's own work (a DFS rollout); a speculative one holds ``units`` of budget (the
        expansions it runs at once)."""
        task = asyncio.create_task(work)
        if speculative and self.budget is not None:
            self._tried()
            self._hold(task, units)
        return task

    def reserve(self, work: Coroutine[Any, Any, Any], units: int) -> asyncio.Task:
        """Run a pre-run (DFS exact: a predicted rollout of ``ahead`` steps) holding ``units`` of the query's
        budget while it runs (its width: the expansions it runs at once)."""
        task = asyncio.create_task(work)
        if self.budget is not None:
            self._hold(task, units)
        return task

    def promote(self, work: asyncio.Task | None = None) -> None:
        """The search used a speculative rollout (a DFS hit): chose it as its next one (``work``, still running:
        its held units go back, for its later steps count as primary work), or folded it in."""
        self.counters.hits += 1
        if self.budget is not None:
            self.budget.hit(self.query)
        release = self._holding.pop(work, None)
        if release is not None:
            release()

    def used(self, expansions: Sequence[Child]) -> None:
        """The search consumed ``expansions`` that ran speculatively (a DFS rollout's speculative steps)."""
        self.counters.saved_expansions += len(expansions)
        self._consumed(expansions)

    async def _result(self, key: ChildKey, job: _Job) -> Child:
        """The job's child (a caller giving up must not cancel a shared expansion: shielded). A failed job leaves
        the cache, so the key runs afresh when asked again: a fold rollout that failed gives its child index back
        and the next one asks for the same keys (it met the stored failure and failed the search)."""
        try:
            return await asyncio.shield(job.task)
        except Exception:
            if self._jobs.get(key) is job:
                del self._jobs[key]
            raise

    def dropped(self, expansions: Sequence[Child], failed: bool = False) -> None:
        """The search gave up a rollout of its own that had run ``expansions`` speculatively (DFS fold): the vote
        settled with it running (one cancelled) or it ``failed`` (one failed, promoted or not); their tokens
        wasted."""
        if failed:
            self.counters.failed += 1
        else:
            self.counters.cancelled += 1
        self.counters.wasted_tokens += sum(c.tokens for c in expansions)

    def retain(self, keep: Callable[[ChildKey], bool], running_only: bool = False) -> None:
        """Cancel every unused speculative expansion whose key ``keep`` rejects (and free its budget);
        ``running_only``: a finished one stays. Without it this is the search moving on: ``keep`` also bounds
        what speculation may start from now on."""
        if not running_only:
            self._keep = keep
            self._widths.clear()  # the search's own widths supersede the predictions
        for key, job in list(self._jobs.items()):
            if job.speculative and not job.used and not keep(key) and not (running_only and job.task.done()):
                if not job.task.done():
                    job.task.cancel()
                    self.counters.cancelled += 1
                elif _succeeded(job.task):
                    self.counters.wasted_tokens += job.task.result().tokens
                del self._jobs[key]

    async def close(self) -> None:
        """Cancel whatever is still running (the search is done), count what it wasted, and wait for the
        cancelled tasks to end (so their budget and run time are counted before the query's record is made).
        A speculative expansion that finished in the search's last pass, its callback still queued, starts
        nothing once the explorer is closed (it used to launch children nobody cancelled, after ``leave``). Once:
        a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        pending = [job.task for job in self._jobs.values() if not job.task.done()]
        self.retain(lambda key: False)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.counters.wasted_tokens += self.expander.counters.cancelled_tokens
        if self.budget is not None:
            self.budget.leave(self.query)

    # -- producers ---------------------------------------------------------------------------------
    def _speculate_children(
        self, siblings: Sequence[Child], pending: int, rule: WidthRule, budget: int, depth_left: int
    ) -> None:
        if depth_left <= 0:
            return
        candidates = [c for c in siblings if not c.final]
        if not candidates:
            return
        open_budget = max(budget - sum(c.final for c in siblings), 0)
        widths = expected_widths(rule, candidates, pending, open_budget)
        if self.retract:
            self._retract({c.node: w for c, w in zip(candidates, widths)})
        keys = [ChildKey(c.state, i, c.node) for c, w in zip(candidates, widths) for i in range(w)]
        keys = [k for k in keys if k not in self._jobs]
        for key in self._granted(keys, siblings, pending, rule, budget, depth_left):
            task = self._launch(key)
            task.add_done_callback(lambda t, b=open_budget, d=depth_left: self._after_speculative(t, rule, b, d))

    def _granted(
        self, keys: list[ChildKey], siblings: Sequence[Child], pending: int, rule: WidthRule, budget: int, depth: int
    ) -> list[ChildKey]:
        """The ``keys`` (children of ``siblings``) the budget grants now; if not all, this ask of
        ``_speculate_children`` is made again when units free up (the level's latest ask stands for its earlier
        ones)."""
        keys = [k for k in keys if self._keep(k)]  # a late ask must not revive what the search has moved away from
        level = len(siblings[0].state)
        granted = keys[: self.spare(len(keys), level, wake=self._woken)]
        if len(granted) < len(keys):
            again = list(siblings)
            self._asks[level] = lambda: self._speculate_children(again, pending, rule, budget, depth)
        else:
            self._asks.pop(level, None)
        return granted

    def _woken(self) -> None:
        asks, self._asks = self._asks, {}
        for ask in asks.values():
            ask()

    def _retract(self, widths: dict[Node, int]) -> None:
        """Cancel the running speculative expansions whose path passes a child beyond its parent's latest
        predicted width: such a child itself (a finished one stays: a later prediction may want it back) and
        whatever runs below it (nothing would ask for that while the width excludes it)."""
        self._widths.update(widths)
        self.retain(self._predicted, running_only=True)

    def _predicted(self, key: ChildKey) -> bool:
        """Whether every child on ``key``'s path, ``key``'s own included, is within its parent's latest width."""
        node = key.node
        return all(node[cut] < self._widths.get(node[:cut], node[cut] + 1) for cut in range(len(node)))

    def _after_speculative(self, task: asyncio.Task, rule: WidthRule, budget: int, depth_left: int) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        # the child's whole level, not its parent's family: the level has ``budget`` nodes (the widths above sum
        # to it), so each one not finished yet, speculated or not, stands in at the finished ones' mean reward
        # (over the family alone, a first speculated child took the whole budget for its own children)
        depth = len(task.result().key.parent)
        level = [
            job.task
            for key, job in self._jobs.items()
            if len(key.parent) == depth and _succeeded(job.task) and self._predicted(key)
        ]
        finished = [t.result() for t in level]
        self._speculate_children(finished, max(budget - len(finished), 0), rule, budget, depth_left - 1)

    def _primary(self, key: ChildKey) -> asyncio.Task:
        task = asyncio.create_task(self.expander.expand(key, PRIMARY))
        self._count_primary(task)
        return task

    def _count_primary(self, task: asyncio.Task) -> None:
        """``task`` counts as primary work in flight (against k_total) until it ends."""
        if self.budget is not None:
            self.budget.primary += 1
            task.add_done_callback(lambda t: self.budget.primary_finished())

    def _launch(self, key: ChildKey, hold: bool = True, priority: int = SPECULATIVE) -> asyncio.Task:
        """A speculative expansion at ``key``; ``hold``: it holds budget itself (not a pre-run's step)."""
        live = LivePriority(priority)
        task = asyncio.create_task(self.expander.expand(key, live))
        self._jobs[key] = _Job(task, speculative=True, priority=live, holds=hold)
        self._tried()
        if hold:
            self._hold(task)  # speculation runs only under a budget (``speculating``)
        return task

    def _consumed(self, expansions: Sequence[Child]) -> None:
        self.counters.expansions_used += len(expansions)
        self.counters.used_tokens += sum(c.tokens for c in expansions)

    def _tried(self) -> None:
        self.counters.speculated += 1
        if self.budget is not None:
            self.budget.tried(self.query)

    def _hold(self, task: asyncio.Task, units: int = 1) -> None:
        """Speculative work holds ``units`` of the query's budget until it ends (or is promoted: ``promote``), and
        counts toward its budget use."""
        self.budget.started(self.query, units)
        self.counters.budget_peak = max(self.counters.budget_peak, self.budget.in_flight[self.query])
        began = time.perf_counter()

        def release() -> None:
            self.budget.finished(self.query, units)
            self.counters.speculative_seconds += units * (time.perf_counter() - began)  # in units, as budget_peak

        def done(_: asyncio.Task) -> None:  # unless promoted first (then released already)
            if self._holding.pop(task, None) is not None:
                release()

        self._holding[task] = release
        task.add_done_callback(done)


def expected_widths(rule: WidthRule, finished: Sequence[Child], pending: int, budget: int) -> list[int]:
    """The widths ``rule`` gives the ``finished`` siblings of a level when each of the ``pending`` siblings
    still running is stood in for by a node scored at the finished ones' mean reward.

    The first children to finish must not get the whole level's budget: under REBASE's width rule
    W_j = round(B softmax(R / T_b)_j) over the finished nodes alone, the first finisher of a B = 4 level
    would get all 4 children, of which the real rule (over all 4 siblings) keeps about one. Worked example,
    B = 4, T_b = 0.2: finished rewards [0.6], 3 pending -> rule over [0.6, 0.6, 0.6, 0.6] -> [1]; finished
    [0.9, 0.5], 2 pending (stand-ins at 0.7) -> softmax [0.54, 0.07, 0.20, 0.20] -> [2, 0].
    """
    if pending <= 0 or not finished:
        return rule(finished, budget)
    prior = sum(c.reward for c in finished) / len(finished)
    parent = finished[0].key.parent
    stand_ins = [
        Child(ChildKey(parent, -1 - i), parent + (f"<pending {i}>",), "", prior, False, "", 0, 0.0)
        for i in range(pending)
    ]
    return rule([*finished, *stand_ins], budget)[: len(finished)]


def _succeeded(task: asyncio.Task) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None
