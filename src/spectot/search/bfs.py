"""Reward-balanced breadth-first search: REBASE (Wu et al. 2024) and ETS (Hooper et al. 2025).

    B <- budget; N_0 <- {root}
    for depth d = 0, 1, ...:
        W_j <- round(B * softmax(R(n_j) / T_b))         REBASE (``rebase_widths``)
               or the ETS ILP's retained nodes' widths   ETS (``ets_select``: reward vs KV cost vs coverage)
        N_{d+1} <- W_j sampled children of every n_j in N_d, each rewarded
        finished children become leaves and reduce the budget: B <- B - |finished|
        stop when B = 0, nothing is open, or the early-termination rule settles
    answer <- weighted majority vote over the leaves (weights = rewards)

Every level's children are asked of the source at once (``level``): with SPEX, children that
finish early are expanded ahead with this same width rule while the level's stragglers run.
"""

from __future__ import annotations

from collections.abc import Sequence

from spectot.search.ets import ets_select, semantic_clusters
from spectot.search.expansion import Child, ChildKey, Node
from spectot.search.rebase import rebase_widths
from spectot.search.tree_search import (
    ChildSource,
    StopRule,
    TreeSearchConfig,
    TreeSearchResult,
    read_open,
    result_of,
    root_child,
    stops,
)
from spectot.tasks.base import Problem, Task


def width_rule(config: TreeSearchConfig):
    """(nodes, budget) -> children per node, by the configured algorithm."""

    def rebase(nodes: Sequence[Child], budget: int) -> list[int]:
        return rebase_widths([n.reward for n in nodes], budget, config.temperature)

    def ets(nodes: Sequence[Child], budget: int) -> list[int]:
        if len(nodes) < 2:
            return rebase(nodes, budget)
        ancestors = [[n.state[:i] for i in range(len(n.state))] for n in nodes]  # proper prefixes: shared KV
        texts = [n.state[-1] if n.state else "" for n in nodes]
        clusters = semantic_clusters(texts, config.cluster_threshold, config.embed)
        rewards = [n.reward for n in nodes]
        return ets_select(rewards, ancestors, clusters, budget, config.temperature, config.lambda_kv, config.lambda_cov)

    return ets if config.algorithm == "ets" else rebase


async def reward_balanced_search(
    task: Task, problem: Problem, source: ChildSource, config: TreeSearchConfig, stop: StopRule | None = None
) -> TreeSearchResult:
    rule = width_rule(config)
    max_depth = config.max_depth or task.depth
    budget, frontier = config.budget, [root_child()]
    leaves: list[Child] = []
    consumed: list[Child] = []
    for _ in range(max_depth):
        widths = rule(frontier, budget)
        keys = [ChildKey(n.state, i, n.node) for n, w in zip(frontier, widths) for i in range(w)]
        if not keys:
            break
        wanted = set(keys)
        places = {k.node for k in wanted}  # what runs under another child of the frontier is never asked for
        source.retain(lambda k, w=wanted, p=places: k in w or _below(k, p))  # drop mis-speculation
        children = await source.level(keys, rule, budget)
        consumed += children
        finished = [c for c in children if c.final]
        leaves += finished
        budget -= len(finished)
        frontier = [c for c in children if not c.final]
        source.retain(lambda k, p={c.node for c in frontier}: _below(k, p))
        if stops(stop, task, leaves):
            return result_of(task, problem, leaves, consumed, stopped=True)
        if budget <= 0 or not frontier:
            break
    if not any(c.answer for c in leaves):  # the depth limit came first (or the finished leaves answered nothing):
        leaves = read_open(task, problem, leaves + [c for c in frontier if c.state])  # the open states answer as
        # they are (what the task reads in them)
    return result_of(task, problem, leaves, consumed, stopped=False)


def _below(key: ChildKey, places: set[Node]) -> bool:
    """Whether ``key`` expands a node at one of ``places`` or a descendant of one."""
    return any(key.at[:n] in places for n in {len(p) for p in places} if len(key.at) >= n)
