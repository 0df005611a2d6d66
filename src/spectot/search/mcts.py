"""Depth-first search by MCTS: rStar-style (Qi et al. 2024) and REST-MCTS (Zhang et al. 2024).

One simulation (llm-reasoners' phases):
    _select    UCT descent from the root (c = 2) to a node that may still get a child
    _rollout   rStar: one new child, then steps to a terminal answer (at most ``max_depth``);
               REST-MCTS: each step expands ``rest_children`` children (fewer at a node's last indices,
               so it gets all ``max_children``) and keeps the best by process reward
    _fold      the rollout's nodes join the tree; its value (rStar: its terminal reward) is backed up along the path
``budget`` simulations in all; the answer is the weighted vote over the terminal leaves (REST-MCTS: with the
answered siblings a step expanded and did not keep).

Deviations from the papers, which change results: rStar (Qi et al. 2024) has five actions (A1 one-step thought,
A2 the remaining steps, A3 a sub-question, A4 re-answer it, A5 rephrase the question); here only A1. It picks
the answer by mutual consistency with a second model (its discriminator); here the reward-weighted vote, and
its terminal rewards are self-consistency counts where here they are the task's self-evaluation. So this is
rStar's search (UCT over one-step thoughts, rollouts to an answer), not its reasoning actions. rStar backs up the
plain mean of the terminal rewards. REST-MCTS* (as its authors' MCTS* does) values a rollout by its process
rewards, V = (1 - alpha) r_1 + alpha max_{i>1} r_i (``uct.rollout_value``: r_1 the first new node's, the max over
the steps below it), and a node's value is the visit-weighted mean of its children's current values
(``uct.weighted_backup``); the task's self-evaluation stands in for the paper's trained process reward model,
whose training targets (the quality values v_k) are not part of a search. A rollout that ends without an
answer (cut at ``max_depth``, or at the task's last step saying none) backs up 0 (no answer, no reward: rStar's
terminal that is no valid answer) and casts no vote, unless no rollout answered:
then the unanswered leaves answer as the task reads their steps (as REBASE's open states do). ``max_depth`` is
the config's, else the task's: the math tasks' default depth 4 keeps within rStar's limit of 5, and a task that
needs more steps (Blocksworld's 6-step plans, depth 7; or an explicit --depth) gets them (a cap at 5 made a 6-step
plan impossible).

SPEX's DFS speculation, two ways (``TreeSearchConfig.dfs_speculation``):

exact (default)  the search is the sequential algorithm, step for step. While its rollout runs,
    ``_predicted`` plays the next selections forward with every pending rollout grafted on as far as
    its steps are known (backed up at its value, or the root's value so far while it runs) and
    ``source.spare()`` of them are pre-run: each is a rollout of ``source.ahead`` expansions, kept by
    the explorer under their ``ChildKey``; the likeliest one's steps run at priority ``NEXT``, the
    others' at ``SPECULATIVE`` (a backend may draft for the first only). An
    expansion's seed is a function of its key, so when the real selection reaches a pre-run
    (node, index) its steps are hits and the tree, the leaves and the answer are the plain
    algorithm's; a pre-run the prediction drops is cancelled (its finished steps stay, in case the
    search comes back to that node).
fold (the paper)  the ``spare()`` extra rollouts start at the nodes the next UCT selections would pick
    if the running ones came back with a virtual loss (virtual visit, value 0). Each is folded into
    the tree when it finishes and counts as one of the ``budget`` simulations; when the real
    selection reaches a node a speculative rollout already started from, that rollout becomes the
    primary one. Every speculative rollout is used, but the search is no longer the sequential one
    (parallel MCTS with virtual loss), so its answers can differ.
With no spare budget both are the sequential algorithm exactly.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from spectot.backends.base import LivePriority
from spectot.search.expansion import NEXT, PRIMARY, SPECULATIVE, Child, ChildKey
from spectot.search.tree_search import (
    ChildSource,
    StopRule,
    TreeSearchConfig,
    TreeSearchResult,
    gather_or_cancel,
    read_open,
    result_of,
    root_child,
    stops,
)
from spectot.search.uct import MctsTree, backup, rollout_value, uct_path, weighted_backup
from spectot.tasks.base import Problem, Task


@dataclass
class _Rollout:
    path: tuple[int, ...]  # selected path, root .. start node
    index: int  # the child index it takes at the start node
    speculative: bool
    priority: int
    ahead: bool = False  # exact speculation: a pre-run whose steps the explorer keeps for the search
    chain: list[list[Child]] = field(default_factory=list)  # per step: the children expanded (best first)
    ran_speculatively: list[Child] = field(default_factory=list)  # children expanded at speculative priority
    waiting: list[ChildKey] = field(default_factory=list)  # the step being expanded now
    progress: asyncio.Event | None = None  # set after each step (exact speculation re-plans)
    live: LivePriority | None = None  # fold: a speculative rollout's steps' priority, raised when it is promoted


@dataclass
class _Tree:
    """The search tree: UCT statistics plus each node's child, the indices handed out, and leaves."""

    stats: MctsTree
    nodes: dict[int, Child]
    next_index: dict[int, int]  # child indices given to rollouts so far (finished or running)
    max_children: int
    width: int  # children one step expands (rStar 1, REST-MCTS rest_children)
    max_depth: int
    alpha: float | None = None  # None: rStar's running mean; REST-MCTS*: the weighted update, rollout_value's alpha
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    returned: dict[int, list[int]] = field(default_factory=dict)  # indices of failed fold rollouts, taken first

    def free(self, node: int) -> bool:
        """Whether ``node`` may still get children: not terminal, above the depth limit, indices left."""
        open_node = node not in self.stats.terminal and len(self.nodes[node].state) < self.max_depth
        return open_node and (bool(self.returned.get(node)) or self.next_index.get(node, 0) < self.max_children)

    def claim(self, node: int) -> int:
        """The child index the next rollout from ``node`` takes: one a failed rollout gave back, else the next."""
        if self.returned.get(node):
            return self.returned[node].pop(0)
        index = self.next_index.get(node, 0)
        self.next_index[node] = index + self.step(index)
        return index

    def give_back(self, node: int, index: int) -> None:
        """A rollout from ``node`` that took ``index`` failed: the next one there takes it again (same keys,
        same seeds), so the node still gets all its children."""
        self.returned.setdefault(node, []).append(index)

    def step(self, first: int) -> int:
        """Children a step expands from child index ``first``: ``width``, fewer at the node's last indices (max
        children 3, width 2: steps of 2 then 1; a node stopped at 2 children)."""
        return min(self.width, self.max_children - first)

    def add(self, parent: int, child: Child) -> int:
        node = next(self.ids)
        self.nodes[node] = child
        children = dict(self.stats.children)
        children[parent] = tuple(children.get(parent, ())) + (node,)
        terminal = self.stats.terminal | {node} if child.final else self.stats.terminal
        self.stats = replace(self.stats, children=children, terminal=terminal)
        return node

    def uct_view(self, running: list[_Rollout]) -> MctsTree:
        """The tree UCT descends: a node stops the descent while it has a free child index; each
        running rollout counts as a virtual visit of value 0 along its path (virtual loss)."""
        stats = replace(self.stats, expandable=frozenset(n for n in self.nodes if self.free(n)))
        for r in running:
            stats = backup(stats, r.path, 0.0)
        return stats

    def back_up(self, path: tuple[int, ...], value: float) -> None:
        """A simulation's value up the path: rStar averages the values backed up through a node; REST-MCTS*
        sets the leaf's and re-weighs each node above by its children's visits (``uct.weighted_backup``)."""
        self.stats = (backup if self.alpha is None else weighted_backup)(self.stats, path, value)

    def rollout(self, chain: list[list[Child]]) -> float:
        """What a rollout brings to the leaf it ends in (and, by the weighted mean, the nodes it grafted above
        it): 0 if it ended without an answer, in both (cut by the depth limit, or at the task's last step with
        nothing to vote for, which the math tasks count as final: rStar gives such a terminal 0; a dead end, no
        answer can come from it, where the authors' rollouts are simulations that stop after a few steps and
        never join the tree); else rStar its terminal reward, REST-MCTS* ``rollout_value`` of its kept steps'
        process rewards."""
        leaf = chain[-1][0]
        if not (leaf.final and leaf.answer):
            return 0.0
        return leaf.reward if self.alpha is None else rollout_value([step[0].reward for step in chain], self.alpha)

    def dead_end(self, node: int) -> float:
        """What selection coming back to a dead end (terminal, or unanswered at the depth limit) backs up: its
        value again; its reward (0 if unanswered) where it has none yet: rStar's every time, and a REST-MCTS
        step's answered sibling, which joined the tree unvisited (its process reward is its value, as the
        authors' children start at theirs)."""
        if self.alpha is not None and self.stats.visits.get(node, 0.0) > 0:
            return self.stats.stats(node).q
        leaf = self.nodes[node]
        return leaf.reward if leaf.final and leaf.answer else 0.0


async def mcts_search(
    task: Task, problem: Problem, source: ChildSource, config: TreeSearchConfig, stop: StopRule | None = None
) -> TreeSearchResult:
    max_depth = config.max_depth or task.depth
    rest = config.algorithm == "rest-mcts"
    width, alpha = (config.rest_children, config.rest_alpha) if rest else (1, None)
    tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, max(config.max_children, width), width, max_depth, alpha)
    search = _exact_search if config.dfs_speculation == "exact" else _folding_search
    return await search(task, problem, source, config, stop, tree)


async def _exact_search(
    task: Task, problem: Problem, source: ChildSource, config: TreeSearchConfig, stop: StopRule | None, tree: _Tree
) -> TreeSearchResult:
    """The sequential algorithm; speculation only pre-runs the rollouts of its predicted next selections."""
    ahead: dict[ChildKey, tuple[asyncio.Task, _Rollout]] = {}  # a pre-run's first child -> the pre-run
    progress = asyncio.Event()  # a rollout finished a step: the prediction may change
    leaves: list[Child] = []
    consumed: list[Child] = []
    run: asyncio.Future | None = None
    try:
        for simulation in range(config.budget):
            path = uct_path(tree.uct_view([]), config.c)
            start = tree.nodes[path[-1]]
            if not tree.free(path[-1]):  # a dead end (terminal, or unanswered at the depth limit): backed up again
                tree.back_up(path, tree.dead_end(path[-1]))
                continue
            rollout = _claim(tree, path, progress)
            run = asyncio.ensure_future(_rollout(source, tree, start, rollout))
            taken = ahead.pop(ChildKey(start.state, rollout.index, start.node), None)
            if taken is not None:  # the search's rollout takes over the pre-run's steps as hits
                taken[0].cancel()
                taken[0].add_done_callback(_quiet)  # a failed pre-run is a miss (its steps are run again)
            while not run.done():
                progress.clear()
                if source.speculating:  # the prediction costs seconds of CPU at large budgets: only when used
                    _pre_run(source, tree, rollout, ahead, config.budget - simulation - 1, config.c)
                woken = asyncio.ensure_future(progress.wait())
                pre_runs = [t for t, _ in ahead.values() if not t.done()]
                try:
                    await asyncio.wait([run, woken, *pre_runs], return_when=asyncio.FIRST_COMPLETED)
                finally:  # the search cancelled while it waits, too
                    woken.cancel()
            run.result()  # a failed expansion fails the search
            leaves += _fold(tree, rollout)
            consumed += [c for step in rollout.chain for c in step]
            if stops(stop, task, leaves):
                return result_of(task, problem, leaves, consumed, stopped=True)
        return result_of(task, problem, read_open(task, problem, leaves), consumed, stopped=False)
    finally:  # the search's own rollout too: a search cancelled mid-rollout left it asking for its next steps
        tasks = [t for t, _ in ahead.values()] + ([run] if run is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _claim(tree: _Tree, path: tuple[int, ...], progress: asyncio.Event | None = None) -> _Rollout:
    """The sequential search's rollout from ``path[-1]``: it takes the node's next child index."""
    return _Rollout(path, tree.claim(path[-1]), False, PRIMARY, progress=progress)


def _pre_run(
    source: ChildSource,
    tree: _Tree,
    primary: _Rollout,
    ahead: dict[ChildKey, tuple[asyncio.Task, _Rollout]],
    remaining: int,
    c: float,
) -> None:
    """Keep the likeliest predicted rollouts pre-running, as many as the query's budget grants (in expansions:
    a rollout runs ``width`` at a time), the likeliest of them at priority ``NEXT``; a running pre-run the
    prediction no longer holds is cancelled."""
    start = tree.nodes[primary.path[-1]]
    chains = {ChildKey(start.state, primary.index, start.node): primary.chain}
    chains |= {key: r.chain for key, (_, r) in ahead.items()}
    running = {k for k, (t, _) in ahead.items() if not t.done()}
    selections = _predicted(tree, chains, primary, remaining, c)
    predicted = [(start, ChildKey(start.state, i, start.node)) for start, i in selections]
    predicted = [(start, key) for start, key in predicted if key not in ahead or key in running]  # finished: kept
    new = source.spare((len(predicted) - len(running)) * tree.width, wake=primary.progress.set) // tree.width
    keep = predicted[: len(running) + new]
    for key in running - {key for _, key in keep}:
        t, dropped = ahead.pop(key)
        t.cancel()
        # its running step is cancelled; a finished one stays, in case the search comes back to that node
        source.retain(lambda k, waiting=frozenset(dropped.waiting): k not in waiting, running_only=True)
    for start, key in [(s, k) for s, k in keep if k not in ahead][:new]:
        rollout = _Rollout((), key.index, True, SPECULATIVE, ahead=True, progress=primary.progress)
        ahead[key] = (source.reserve(_rollout(source, tree, start, rollout), tree.width), rollout)
    for rank, key in enumerate(key for _, key in keep if key in ahead):  # its next steps run at this priority
        ahead[key][1].priority = NEXT if rank == 0 else SPECULATIVE


def _predicted(
    tree: _Tree, chains: Mapping[ChildKey, list[list[Child]]], pending: _Rollout, n: int, c: float
) -> list[tuple[Child, int]]:
    """(start node, child index) of the next ``n`` selections of the sequential search, likeliest first, with
    the ``pending`` rollout and every predicted one grafted on as far as they are known (``chains``: their
    steps so far) and backed up at their value, or a stand-in while they run (the root's value so far).

    A rollout still running ends in an unknown child (an id not in ``nodes``). A descent that picks an
    unknown child names no rollout to pre-run: it leaves a virtual visit on its path and the next descent
    hedges on the likeliest known alternative. A dead end is backed up with its own value, as the search
    does. Worked example (rStar, 3 children a node): the search's first rollout pending at the root with
    nothing known yet, n = 3 -> [(root, 1), (root, 2)]: the root's indices 1 and 2 come whatever the
    rewards; the third descent enters the unknown child of index 0 (nothing known below it to pre-run).
    """
    visits = tree.stats.visits.get(0, 0.0)
    stand_in = tree.stats.value.get(0, 0.0) / visits if visits else 0.5
    returned = {node: list(indices) for node, indices in tree.returned.items()}
    view = replace(
        tree, nodes=dict(tree.nodes), next_index=dict(tree.next_index), returned=returned, ids=itertools.count(-1, -1)
    )

    def pend(path: tuple[int, ...], index: int) -> None:
        start = view.nodes[path[-1]]
        chain = chains.get(ChildKey(start.state, index, start.node), [])
        grown = _graft(view, path, chain)
        leaf = chain[-1][0] if chain else None
        if leaf is not None and (leaf.final or len(leaf.state) >= view.max_depth):
            view.back_up(grown, view.rollout(chain))
            return
        unknown = next(view.ids)
        children = dict(view.stats.children)
        children[grown[-1]] = tuple(children.get(grown[-1], ())) + (unknown,)
        view.stats = replace(view.stats, children=children)
        view.back_up((*grown, unknown), stand_in)

    pend(pending.path, pending.index)
    selections: list[tuple[Child, int]] = []
    for _ in range(4 * n):  # each descent names a rollout, backs up a dead end, or visits an unknown child
        if len(selections) == n:
            break
        path = uct_path(view.uct_view([]), c)
        start = path[-1]
        if start not in view.nodes:
            view.back_up(path, stand_in)
            continue
        if not view.free(start):
            view.back_up(path, view.dead_end(start))
            continue
        index = view.claim(start)
        selections.append((view.nodes[start], index))
        pend(path, index)
    return selections


async def _folding_search(
    task: Task, problem: Problem, source: ChildSource, config: TreeSearchConfig, stop: StopRule | None, tree: _Tree
) -> TreeSearchResult:
    """The paper's DFS speculation: speculative rollouts are folded in as simulations of their own."""
    running: dict[asyncio.Task, _Rollout] = {}
    primary: _Rollout | None = None
    leaves: list[Child] = []
    consumed: list[Child] = []
    launched = folded = 0
    freed = asyncio.Event()  # budget units freed up after the query was refused some: it asks again

    def launch(path: tuple[int, ...], speculative: bool) -> _Rollout:
        nonlocal launched
        start = path[-1]
        rollout = _Rollout(path, tree.claim(start), speculative, SPECULATIVE if speculative else PRIMARY)
        if speculative:  # its steps run at a priority the search raises if it makes the rollout its primary one
            rollout.live = LivePriority(SPECULATIVE)
        # a rollout runs ``width`` expansions at once: it holds that many units of the budget
        running[source.start(_rollout(source, tree, tree.nodes[start], rollout), speculative, tree.width)] = rollout
        launched += 1
        return rollout

    try:
        while folded < config.budget:
            # -- select: the primary rollout is the sequential algorithm's next simulation
            if primary is None and launched < config.budget:
                path = uct_path(tree.uct_view([]), config.c)
                waiting = [r for r in running.values() if r.speculative and r.path[-1] == path[-1]]
                if waiting:  # a speculative rollout already started where the real selection went
                    primary = waiting[0]
                    primary.speculative, primary.priority = False, PRIMARY
                    primary.live.set(PRIMARY)  # its running step too, not only the next ones
                    source.promote(next(t for t, r in running.items() if r is primary))  # its budget goes back
                elif tree.free(path[-1]):
                    primary = launch(path, speculative=False)
                else:  # a dead end (terminal, or unanswered at the depth limit): its value is backed up again
                    tree.back_up(path, tree.dead_end(path[-1]))
                    launched, folded = launched + 1, folded + 1
                    continue
            # -- speculate: the next selections under virtual loss, within the query's budget
            freed.clear()
            spare = source.spare((config.budget - launched) * tree.width, 1, freed.set) // tree.width
            for _ in range(max(0, min(spare, config.budget - launched))):
                path = uct_path(tree.uct_view(list(running.values())), config.c)
                if not tree.free(path[-1]):
                    break
                launch(path, speculative=True)
            if not running:
                break
            woken = asyncio.ensure_future(freed.wait())
            try:
                done, _ = await asyncio.wait([*running, woken], return_when=asyncio.FIRST_COMPLETED)
            finally:  # the search cancelled while it waits, too
                woken.cancel()
            for finished in [t for t in running if t in done]:  # in launch order: a set's order is by address
                rollout = running.pop(finished)
                if rollout.live is not None and finished.exception() is not None:
                    # a rollout started speculatively failed (a timeout, an aborted low-priority request): a
                    # miss, not the search's failure; another rollout takes its place, and its child index
                    source.dropped(rollout.ran_speculatively, failed=True)
                    tree.give_back(rollout.path[-1], rollout.index)
                    launched -= 1
                    if rollout is primary:
                        primary = None
                    continue
                finished.result()  # a failed primary expansion fails the search
                folded_leaves = _fold(tree, rollout)
                consumed += [c for step in rollout.chain for c in step]
                source.used(rollout.ran_speculatively)
                folded += 1
                if rollout.speculative:  # folded in as one of the simulations
                    source.promote()
                if rollout is primary:
                    primary = None
                leaves += folded_leaves
            if stops(stop, task, leaves):
                return result_of(task, problem, leaves, consumed, stopped=True)
        return result_of(task, problem, read_open(task, problem, leaves), consumed, stopped=False)
    finally:
        for t, rollout in running.items():
            t.cancel()
            if rollout.speculative:  # the vote settled (or the search failed) with it still running
                source.dropped(rollout.ran_speculatively)
        await asyncio.gather(*running, return_exceptions=True)


def _quiet(task: asyncio.Task) -> None:
    """Retrieve a finished task's exception (one nobody awaits anymore), so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


async def _rollout(source: ChildSource, tree: _Tree, start: Child, r: _Rollout):
    """Steps from ``start`` to a terminal state (or the tree's depth limit), ``tree.width`` children a step;
    fills ``r.chain``."""
    parent, first = start, r.index
    while True:
        r.waiting = [ChildKey(parent.state, first + i, parent.node) for i in range(tree.step(first))]
        priority = r.priority  # a promoted rollout's later steps run as primary work (a pre-run's: as it ranks)
        if r.ahead:
            children = await asyncio.gather(*[source.ahead(k, priority) for k in r.waiting])  # started at once
        else:
            ask = r.live if r.live is not None and priority != PRIMARY else priority
            children = await gather_or_cancel(source.expand(k, ask) for k in r.waiting)
        if priority == SPECULATIVE and not r.ahead:
            r.ran_speculatively += children
        # REST-MCTS keeps the best by process reward, a child that would end the rollout without an answer last (it
        # backs up 0, ``_Tree.rollout``; an answered child rated 0 still beats it)
        ends_unanswered = lambda c: (c.final or len(c.state) >= tree.max_depth) and not c.answer  # noqa: E731
        step = sorted(children, key=lambda c: (ends_unanswered(c), -c.reward))
        r.chain.append(step)
        if r.progress is not None:
            r.progress.set()
        parent, first = step[0], 0
        if parent.final or len(parent.state) >= tree.max_depth:
            return


def _fold(tree: _Tree, r: _Rollout) -> list[Child]:
    """Add the rollout's nodes and back up its value; returns the leaves it brings to the vote: its last child
    (terminal, or unanswered at the depth limit), then REST-MCTS's finished siblings it did not keep (answers the
    search paid for: left out, they never voted, and UCT's first visit to one only backed its reward up again)."""
    path, leaf = _graft(tree, r.path, r.chain), r.chain[-1][0]
    tree.back_up(path, tree.rollout(r.chain))
    return [leaf, *(c for step in r.chain for c in step[1:] if c.final)]


def _graft(tree: _Tree, path: tuple[int, ...], chain: list[list[Child]]) -> tuple[int, ...]:
    """Add a rollout's steps under ``path[-1]`` (the kept child of each step continues the path; it took
    child indices 0 .. width - 1 of the node above); returns ``path`` grown by the kept nodes."""
    parent, grown = path[-1], list(path)
    for step in chain:
        kept = tree.add(parent, step[0])
        for sibling in step[1:]:
            tree.add(parent, sibling)
        tree.next_index[kept] = tree.width  # its own step (the next one, or the one running) took 0 .. width - 1
        grown.append(kept)
        parent = kept
    return tuple(grown)
