"""Depth-first search by MCTS: rStar-style (Qi et al. 2024) and REST-MCTS (Zhang et al. 2024).

One simulation (llm-reasoners' phases):
    _select    UCT descent from the root (c = 2) to a node that may still get a child
    _rollout   rStar: one new child, then steps to a terminal answer (at most ``max_depth``);
               REST-MCTS: each step expands ``rest_children`` children and keeps the best by process reward
    _fold      the rollout's nodes join the tree; its terminal reward is backed up along the path
``budget`` simulations in all; the answer is the weighted vote over the terminal leaves.

SPEX's DFS speculation: while the next (primary) rollout runs, ``source.spare()`` more rollouts start
at the nodes the next UCT selections would pick if the running ones came back with a virtual loss
(virtual visit, value 0). Each is folded into the tree when it finishes and counts as one of the
``budget`` simulations; when the real selection reaches a node a speculative rollout already started
from, that rollout becomes the primary one. Either way the search used it (a hit); rollouts still
running when the search ends are the waste. With no spare budget this is the sequential algorithm
exactly.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, replace

from spectot.search.expansion import PRIMARY, SPECULATIVE, Child, ChildKey
from spectot.search.tree_search import (
    ChildSource,
    StopRule,
    TreeSearchConfig,
    TreeSearchResult,
    result_of,
    root_child,
    vote,
)
from spectot.search.uct import MctsTree, backup, uct_path
from spectot.tasks.base import Problem, Task

RSTAR_MAX_DEPTH = 5


@dataclass
class _Rollout:
    path: tuple[int, ...]  # selected path, root .. start node
    index: int  # the child index it takes at the start node
    speculative: bool
    priority: int
    chain: list[list[Child]] = field(default_factory=list)  # per step: the children expanded (best first)
    ran_speculatively: list[Child] = field(default_factory=list)  # children expanded at speculative priority


@dataclass
class _Tree:
    """The search tree: UCT statistics plus each node's child, the indices handed out, and leaves."""

    stats: MctsTree
    nodes: dict[int, Child]
    next_index: dict[int, int]  # child indices given to rollouts so far (finished or running)
    max_children: int
    width: int  # children one step expands (rStar 1, REST-MCTS rest_children)
    max_depth: int
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def free(self, node: int) -> bool:
        """Whether ``node`` may still get children: not terminal, above the depth limit, indices left."""
        open_node = node not in self.stats.terminal and len(self.nodes[node].state) < self.max_depth
        return open_node and self.next_index.get(node, 0) + self.width <= self.max_children

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


async def mcts_search(
    task: Task, problem: Problem, source: ChildSource, config: TreeSearchConfig, stop: StopRule | None = None
) -> TreeSearchResult:
    max_depth = min(config.max_depth or task.depth, RSTAR_MAX_DEPTH)
    width = config.rest_children if config.algorithm == "rest-mcts" else 1
    tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, max(config.max_children, width), width, max_depth)
    running: dict[asyncio.Task, _Rollout] = {}
    primary: _Rollout | None = None
    leaves: list[Child] = []
    consumed: list[Child] = []
    launched = folded = 0

    def launch(path: tuple[int, ...], speculative: bool) -> _Rollout:
        nonlocal launched
        start = path[-1]
        rollout = _Rollout(path, tree.next_index.get(start, 0), speculative, SPECULATIVE if speculative else PRIMARY)
        tree.next_index[start] = rollout.index + tree.width
        work = _rollout(task, source, config, tree.nodes[start], rollout, max_depth)
        running[source.start(work, speculative)] = rollout
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
                    source.promote()
                elif tree.free(path[-1]):
                    primary = launch(path, speculative=False)
                else:  # a dead end (terminal, or unanswered at the depth limit): its reward is backed up again
                    tree.stats = backup(tree.stats, path, tree.nodes[path[-1]].reward)
                    launched, folded = launched + 1, folded + 1
                    continue
            # -- speculate: the next selections under virtual loss, within the query's budget
            spare = source.spare(config.budget - launched, depth=1)
            for _ in range(max(0, min(spare, config.budget - launched))):
                path = uct_path(tree.uct_view(list(running.values())), config.c)
                if not tree.free(path[-1]):
                    break
                launch(path, speculative=True)
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                rollout = running.pop(finished)
                finished.result()  # a failed expansion fails the search
                leaf = _fold(tree, rollout)
                consumed += [c for step in rollout.chain for c in step]
                source.used(rollout.ran_speculatively)
                folded += 1
                if rollout.speculative:  # folded in as one of the simulations
                    source.promote()
                if rollout is primary:
                    primary = None
                leaves.append(leaf)
            if stop is not None and leaves and stop(vote(task, leaves), len(leaves)):
                return result_of(task, problem, leaves, consumed, stopped=True)
        return result_of(task, problem, leaves, consumed, stopped=False)
    finally:
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def _rollout(task: Task, source: ChildSource, config: TreeSearchConfig, start: Child, r: _Rollout, depth: int):
    """Steps from ``start`` to a terminal state (or the depth limit); fills ``r.chain``."""
    width = config.rest_children if config.algorithm == "rest-mcts" else 1
    parent, first = start, r.index
    while True:
        keys = [ChildKey(parent.state, first + i) for i in range(width)]
        priority = r.priority  # a promoted rollout's later steps run as primary work
        children = await asyncio.gather(*(source.expand(k, priority) for k in keys))
        if priority == SPECULATIVE:
            r.ran_speculatively += children
        step = sorted(children, key=lambda c: -c.reward)  # REST-MCTS keeps the best by process reward
        r.chain.append(step)
        parent, first = step[0], 0
        if parent.final or len(parent.state) >= depth:
            return


def _fold(tree: _Tree, r: _Rollout) -> Child:
    """Add the rollout's nodes (the kept one of each step continues the path) and back up its reward;
    returns its last child (terminal, or unanswered at the depth limit)."""
    parent, path = r.path[-1], list(r.path)
    for j, step in enumerate(r.chain):
        kept = tree.add(parent, step[0])
        for sibling in step[1:]:
            tree.add(parent, sibling)
        if j + 1 < len(r.chain):  # the next step took child indices 0 .. width - 1 of the kept node
            tree.next_index[kept] = len(r.chain[j + 1])
        path.append(kept)
        parent = kept
    leaf = r.chain[-1][0]
    tree.stats = backup(tree.stats, path, leaf.reward)
    return leaf
