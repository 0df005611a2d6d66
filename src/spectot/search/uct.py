"""UCT selection for MCTS over reasoning steps (rStar, Qi et al. 2024; REST-MCTS*, Zhang et al. 2024), with the
virtual visits SPEX uses to speculate on the next selections.

Owns the tree statistics (``MctsTree``), the UCT score and argmax, the k-path speculative selection and the
back-up, all pure: a new tree comes back, the input is never changed. Vocabulary:

    N(n)   visits of node n                W(n)   total value backed up through n       Q(n) = W(n) / N(n)
    UCT(s, a) = Q(s, a) + c * sqrt(ln N(s) / N(s, a))     (c = 2 as in rStar; an unvisited child scores +inf)

Virtual visits (virtual loss). SPEX simulates the next k UCT selections before any of them is rolled out: after
each simulated descent every node on its path counts one more (virtual) visit with a virtual value, so the next
descent sees it as explored and spreads to other branches. Worked example: a root with three unvisited children
a, b, c (ids 1, 2, 3) and k = 3: descent 1 picks a (all +inf, lowest index), then a has one virtual visit and a
finite score, so descent 2 picks b and descent 3 picks c: paths [(0, 1), (0, 2), (0, 3)]. Descent 1 is always
plain UCT, since nothing is virtual yet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

Path = tuple[int, ...]  # node ids from the root to the selected node


@dataclass(frozen=True)
class NodeStats:
    visits: float = 0.0  # N
    value: float = 0.0  # W: total value
    virtual_visits: float = 0.0  # visits of speculative descents not yet rolled out
    virtual_value: float = 0.0  # the value those descents are assumed to bring (total)

    @property
    def n(self) -> float:
        """N + virtual visits: the count UCT sees."""
        return self.visits + self.virtual_visits

    @property
    def q(self) -> float:
        """Q = (W + virtual value) / (N + virtual visits); 0 when never visited."""
        return (self.value + self.virtual_value) / self.n if self.n > 0 else 0.0


@dataclass(frozen=True)
class MctsTree:
    children: Mapping[int, tuple[int, ...]]  # node -> its children, in creation order (absent: none yet)
    visits: Mapping[int, float] = field(default_factory=dict)  # N(n), absent = 0
    value: Mapping[int, float] = field(default_factory=dict)  # W(n), absent = 0
    terminal: frozenset[int] = frozenset()  # nodes that end a solution: selection stops there, never expanded
    expandable: frozenset[int] = frozenset()  # nodes that may still get a new child: selection stops there
    root: int = 0

    def stats(self, node: int) -> NodeStats:
        return NodeStats(self.visits.get(node, 0.0), self.value.get(node, 0.0))

    @classmethod
    def make_dummy(cls, branching: int = 3) -> MctsTree:
        """A fully expanded root (0, visited once) with ``branching`` unvisited leaf children 1..branching."""
        return cls(children={0: tuple(range(1, branching + 1))}, visits={0: 1.0})


def uct_score(q: float, n_parent: float, n_child: float, c: float = 2.0) -> float:
    """UCT = Q + c sqrt(ln N(parent) / N(child)); +inf for an unvisited child."""
    if n_child <= 0:
        return math.inf
    return q + c * math.sqrt(math.log(max(n_parent, 1.0)) / n_child)  # ln N(s) / N(s, a); ln 1 = 0 explores none


def uct_select(children: Sequence[NodeStats], c: float = 2.0, n_parent: float | None = None) -> int:
    """Index of the child with the largest UCT (ties: lowest index), virtual visits counted.

    n_parent: N(s) of the parent (its own visits plus virtual ones); None takes the sum of the children's counts.
    """
    if not children:
        raise ValueError("uct_select needs at least one child")
    parent = sum(child.n for child in children) if n_parent is None else n_parent
    scores = [uct_score(child.q, parent, child.n, c) for child in children]
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def is_selection_leaf(tree: MctsTree, node: int) -> bool:
    """Selection stops at a terminal node, a node that may still be expanded, or a node without children."""
    return node in tree.terminal or node in tree.expandable or not tree.children.get(node)


def simulate_selections(tree: MctsTree, k: int, c: float = 2.0, virtual_value: float = 0.0) -> list[Path]:
    """k successive UCT descents from the root, each leaving one virtual visit (worth virtual_value) on its path."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    virtual_n: dict[int, float] = {}
    virtual_w: dict[int, float] = {}

    def stats(node: int) -> NodeStats:
        base = tree.stats(node)
        return replace(base, virtual_visits=virtual_n.get(node, 0.0), virtual_value=virtual_w.get(node, 0.0))

    paths: list[Path] = []
    for _ in range(k):
        path = [tree.root]
        while not is_selection_leaf(tree, path[-1]):
            kids = tree.children[path[-1]]
            best = uct_select([stats(kid) for kid in kids], c, n_parent=stats(path[-1]).n)
            path.append(kids[best])
        for node in path:  # virtual loss: the next descent sees this path as visited once more
            virtual_n[node] = virtual_n.get(node, 0.0) + 1.0
            virtual_w[node] = virtual_w.get(node, 0.0) + virtual_value
        paths.append(tuple(path))
    return paths


def uct_path(tree: MctsTree, c: float = 2.0) -> Path:
    """Plain UCT selection: the one descent from the root with no virtual statistics."""
    return simulate_selections(tree, 1, c)[0]


def backup(tree: MctsTree, path: Sequence[int], reward: float) -> MctsTree:
    """A new tree with N(n) += 1 and W(n) += reward for every node n on the path."""
    visits, value = dict(tree.visits), dict(tree.value)
    for node in path:
        visits[node] = visits.get(node, 0.0) + 1.0
        value[node] = value.get(node, 0.0) + reward
    return replace(tree, visits=visits, value=value)


def weighted_backup(tree: MctsTree, path: Sequence[int], leaf_value: float) -> MctsTree:
    """REST-MCTS*'s update (Zhang et al. 2024, as the authors' MCTS* backs up): N(n) += 1 along the path, the
    leaf's value becomes ``leaf_value``, and each node above it, from the leaf up, takes the visit-weighted mean
    of its children's values,  V(n) = sum_c N(c) V(c) / sum_c N(c)  (a child never visited weighs 0).

    W = V N is stored, so Q = W / N reads V. Unlike ``backup``'s running mean, a node follows its children's
    current values: a leaf that changes value moves its ancestors at once. Worked example: a root whose child
    a has two children worth 1.0 and 0.0 (one visit each): V(a) = 0.5; a visit that sets the first to 0.2 gives
    N = (2, 1), V(a) = (2 * 0.2 + 0.0) / 3 = 0.133 (a running mean would say (1.0 + 0.0 + 0.2) / 3 = 0.4).
    """
    visits, value = dict(tree.visits), dict(tree.value)
    for node in path:
        visits[node] = visits.get(node, 0.0) + 1.0
    value[path[-1]] = leaf_value * visits[path[-1]]
    for node in reversed(path[:-1]):
        kids = tree.children.get(node, ())
        v = sum(value.get(kid, 0.0) for kid in kids) / sum(visits.get(kid, 0.0) for kid in kids)  # W(c) = V(c) N(c)
        value[node] = v * visits[node]
    return replace(tree, visits=visits, value=value)


def rollout_value(rewards: Sequence[float], alpha: float) -> float:
    """What a REST-MCTS* rollout is worth to its first new node: V = (1 - alpha) r_1 + alpha max_{i > 1} r_i,
    r_1 that node's process reward, the max over the steps the rollout took below it (the authors' greedy
    rollout; their alpha is 0.5); r_1 alone when the rollout is one step."""
    if len(rewards) == 1:
        return rewards[0]
    return (1.0 - alpha) * rewards[0] + alpha * max(rewards[1:])


def add_child(tree: MctsTree, parent: int, child: int, terminal: bool = False, parent_full: bool = False) -> MctsTree:
    """A new tree with ``child`` (unvisited) appended to ``parent``'s children.

    The child may be expanded later unless it is terminal; ``parent_full`` says the parent gets no more children,
    so selection descends through it from now on.
    """
    known = {tree.root} | set(tree.children) | {kid for kids in tree.children.values() for kid in kids}
    if child in known:
        raise ValueError(f"node id {child} is already in the tree; give every new node a fresh id")
    children = dict(tree.children)
    children[parent] = tuple(children.get(parent, ())) + (child,)
    terminal_nodes = tree.terminal | {child} if terminal else tree.terminal
    expandable = tree.expandable if terminal else tree.expandable | {child}
    if parent_full:
        expandable = expandable - {parent}
    return replace(tree, children=children, terminal=terminal_nodes, expandable=expandable)
