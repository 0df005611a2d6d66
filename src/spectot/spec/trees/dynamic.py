"""Dynamic draft-tree policies: which candidate children a drafter adds at each depth, and which nodes it keeps.

A drafter grows a token tree below the root (node 0: the last verified token, path confidence 1) one depth
at a time. At depth d it holds the frontier (the nodes added at depth d - 1, in the order they were added)
and, for each frontier node, the draft's probabilities of its top-K candidate children, sorted descending.
A policy's ``expand`` names the children to add as (frontier index, rank) pairs; after the last depth its
``finalize`` may drop nodes. The policies here are pure: numbers in, decisions out, no model calls.

Vocabulary. The path confidence of a node is f(v) = product of the draft probabilities along the path from
the root (the root has f = 1). It is Sequoia's f(v) with draft probabilities standing in for acceptance
rates: EAGLE-2 (Li et al. 2024, section 3) and PCT (Zheng & Wang, ACL 2025) both find draft confidence well
calibrated to acceptance, so sum_v f(v) estimates the acceptance length of the tree (root term included: the
acceptance length counts the bonus token).

Conventions every policy follows (``grow``, the reference drafter the tests run every policy through, checks
them with ``check_expansion`` and ``keep_subtree``; the draft decoder's drafter relies on them unchecked):
  - expand's pairs are grouped by frontier index ascending, ranks ascending within a group and without gaps
    (rank r only if rank r - 1 is added);
  - the drafter appends the children in exactly that order, so nodes are numbered breadth-first with siblings
    in rank order, and the frontier at depth d + 1 is the list of children expand returned at depth d;
  - ``frontier_to_expand`` names the frontier rows expand may read: the drafter may skip the draft forward
    for the other rows (their values are never read);
  - finalize returns sorted node indices containing the root and closed under ancestors.

Worked example (``grow`` with these draft probabilities; a path is the tuple of ranks from the root):

    child_probs_of(())   = [0.6, 0.3]     root -> a (f = 0.6), b (f = 0.3)
    child_probs_of((0,)) = [0.9, 0.05]    a    -> c (f = 0.54), d (f = 0.03)
    child_probs_of((1,)) = [0.5, 0.4]     b    -> e (f = 0.15), g (f = 0.12)

  EAGLE2Policy(top_k=2, depth=2, total_tokens=3): depth 1 adds a, b; depth 2 expands the 2 most confident
  frontier nodes (a and b) by 2 children each:
      nodes   = [r, a, b, c, d, e, g]
      parents = [-1, 0, 0, 1, 1, 2, 2]
      f       = [1, .6, .3, .54, .03, .15, .12]
  the rerank keeps the 3 most confident non-root nodes (a .6, c .54, b .3), renumbered breadth-first:
      grow -> parents [-1, 0, 0, 1], f [1, .6, .3, .54]          r -> a -> c,  r -> b

  PCTPolicy(threshold=0.35, width=2, max_depth=2, leaf_threshold=0.05): r and a (f >= 0.35) are expanded,
  b (f = 0.3) is not: parents [-1, 0, 0, 1, 1]; finalize drops the leaf d (f = 0.03 < 0.05):
      grow -> parents [-1, 0, 0, 1], f [1, .6, .3, .54]          (the same tree)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import torch

from spectot.spec.sampling import SamplingParams


class TreePolicy(Protocol):
    """How a drafter grows and trims a draft tree; see the module docstring for the conventions."""

    @property
    def max_depth(self) -> int:
        """Draft depths at most (the root is depth 0, its children depth 1)."""
        ...

    @property
    def max_children(self) -> int:
        """K: how many top candidates per frontier node the drafter must supply."""
        ...

    def frontier_to_expand(self, depth: int, path_conf: torch.Tensor) -> list[int]:
        """Frontier indices (ascending) whose child_probs rows ``expand`` at this depth may read."""
        ...

    def expand(self, depth: int, path_conf: torch.Tensor, child_probs: torch.Tensor) -> list[tuple[int, int]]:
        """depth: depth of the children about to be added (1..max_depth).
        path_conf: (m,) float, f of each frontier node. child_probs: (m, K) float, sorted descending per row.
        -> (frontier index, rank) pairs, grouped by frontier index ascending, ranks 0, 1, ... without gaps."""
        ...

    def finalize(self, parents: list[int], path_conf: list[float]) -> list[int]:
        """parents[0] = -1, path_conf[0] = 1 -> sorted kept nodes, containing 0 and closed under ancestors."""
        ...


def refuse_sampled_pruning(policy: TreePolicy | None, children: str) -> None:
    """A policy that keeps or drops siblings by their own draft probability (PCT, CaPE, EAGLE-2) turns sampled
    siblings into something other than the independent / without-replacement draws from q that verification
    assumes (q = [0.9, 0.1], two draws, keep the likelier: the kept child is always the first token, yet it is
    verified as one fresh draw from q, so with p = [0.5, 0.5] the output is 0.556 / 0.444, not p)."""
    if children != "top" and getattr(policy, "prunes_siblings", False):
        raise ValueError(
            f"{type(policy).__name__} keeps or drops siblings by their draft probability, so sampled siblings "
            f"({children}) would not be the draws from q verification assumes: use top children"
        )


# (streams sharing the forward, their sampling) -> the tree each drafts (None: the proposer's own)
TreeBudget = Callable[[int, "SamplingParams"], "TreePolicy | None"]


# ---------------------------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True)
class StaticPolicy:
    """A fixed shape (``shapes.k_config_tree``, ``sequoia.sequoia_tree``, ...) grown through the dynamic interface.

    A shape node's children are its candidates of ranks 0, 1, ... in index order. The shape is renumbered
    breadth-first (``bfs_order``) because that is the order the drafter creates nodes in: the j-th frontier
    node at depth d is then the j-th shape node of depth d - 1. ``grow`` returns ``self.shape``.
    """

    parents: tuple[int, ...]
    shape: tuple[int, ...] = field(init=False)  # parents renumbered breadth-first, siblings in index order
    levels: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # levels[d]: shape nodes at depth d
    n_children: tuple[int, ...] = field(init=False, repr=False)  # children per shape node

    def __post_init__(self) -> None:
        shape = tuple(bfs_order(self.parents))
        depths = _depths(shape)
        levels: list[list[int]] = [[] for _ in range(max(depths) + 1)]
        n_children = [0] * len(shape)
        for node, parent in enumerate(shape):
            levels[depths[node]].append(node)
            if parent >= 0:
                n_children[parent] += 1
        object.__setattr__(self, "parents", tuple(self.parents))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "levels", tuple(tuple(level) for level in levels))
        object.__setattr__(self, "n_children", tuple(n_children))

    @property
    def max_depth(self) -> int:
        return len(self.levels) - 1

    @property
    def max_children(self) -> int:
        return max(self.n_children)

    def frontier_to_expand(self, depth: int, path_conf: torch.Tensor) -> list[int]:
        return [j for j, node in enumerate(self._frontier(depth, path_conf)) if self.n_children[node]]

    def expand(self, depth: int, path_conf: torch.Tensor, child_probs: torch.Tensor) -> list[tuple[int, int]]:
        frontier = self._frontier(depth, path_conf)
        return [(j, rank) for j, node in enumerate(frontier) for rank in range(self.n_children[node])]

    def finalize(self, parents: list[int], path_conf: list[float]) -> list[int]:
        return list(range(len(parents)))

    def _frontier(self, depth: int, path_conf: torch.Tensor) -> tuple[int, ...]:
        """Shape nodes of depth - 1, which are the frontier when the drafter followed the conventions."""
        if not 1 <= depth <= self.max_depth:
            return ()
        frontier = self.levels[depth - 1]
        if path_conf.numel() != len(frontier):
            raise ValueError(
                f"the shape has {len(frontier)} nodes at depth {depth - 1} but the frontier has {path_conf.numel()}: "
                "the drafter must add exactly the children expand returns, in that order"
            )
        return frontier


@dataclass(frozen=True, kw_only=True)
class PCTPolicy:
    """Pruned Candidate Tree (Zheng & Wang, "Faster Speculative Decoding via Effective Draft Decoder with
    Pruned Candidate Tree", ACL 2025): keep only the nodes whose expected time gain is positive.

    Expanding node v (one draft step on v, cost ~ s_d) helps only if v is accepted, which happens with
    probability ~ f(v) (calibrated draft confidence), and each accepted token saves ~ one target step s_t:

        expand v  <=>  f(v) * s_t >= s_d  <=>  f(v) >= threshold = s_d / s_t

    Each expandable frontier node gets its top ``width`` candidates; growth stops when no frontier node is
    expandable (expand returns []). finalize drops leaves with f < ``leaf_threshold``, repeatedly (a parent
    left childless may go next), never the root, then keeps the ``max_nodes`` most confident nodes.

    ``max_nodes`` counts the root. expand sees one depth, not the tree size, so it caps each depth at
    max_nodes - 1 children (the most confident); finalize enforces the cap on the whole tree. With draft
    probabilities summing to <= 1 at most 1 / threshold nodes per depth are expandable, which bounds drafting.

    Verification is not free either: a forward over n rows costs t(n) target steps, flat while the weights'
    memory traffic dominates, then growing with n once compute does (this machine's t(n), ``spec/profile.py``).
    With ``verify_cost`` = t, finalize keeps only the ``verified_tree_size`` most confident nodes, the size
    whose expected tokens per unit of verification time is largest. When B streams share each forward, their
    trees together cost t(B m): ``for_streams(B)`` prices a tree of m rows at t(B m) / t(B) (each stream taken to
    draft alike), so the trees shrink as the batch grows.
    """

    prunes_siblings: ClassVar[bool] = True  # keeps or drops siblings by their own draft probability

    threshold: float  # s_d / s_t: draft step time over target step time
    width: int = 3  # top-k children per expandable node
    max_depth: int = 8
    leaf_threshold: float = 0.0
    max_nodes: int = 64  # root included
    verify_cost: Callable[[float], float] | None = None  # t(n) / t(1) of a target forward over n rows

    def __post_init__(self) -> None:
        if not (self.threshold >= 0 and self.leaf_threshold >= 0):  # NaN too: it never expanded, drafted nothing
            raise ValueError(
                f"threshold (s_d / s_t) and leaf_threshold must be >= 0, got {self.threshold}, {self.leaf_threshold}"
            )
        _check_at_least("width", self.width, 1)
        _check_at_least("max_depth", self.max_depth, 1)
        _check_at_least("max_nodes", self.max_nodes, 1)

    @property
    def max_children(self) -> int:
        return self.width

    def frontier_to_expand(self, depth: int, path_conf: torch.Tensor) -> list[int]:
        if depth > self.max_depth:
            return []
        return [i for i, f in enumerate(path_conf.tolist()) if f >= self.threshold]  # host sync

    def expand(self, depth: int, path_conf: torch.Tensor, child_probs: torch.Tensor) -> list[tuple[int, int]]:
        rows = self.frontier_to_expand(depth, path_conf)
        return _most_confident_children(path_conf, child_probs, {i: self.width for i in rows}, self.max_nodes - 1)

    def for_streams(self, streams: int) -> PCTPolicy:
        """This policy with its verification priced for ``streams`` streams sharing each forward."""
        if self.verify_cost is None or streams <= 1:
            return self
        return replace(self, verify_cost=_SharedForward(self.verify_cost, streams))

    def finalize(self, parents: list[int], path_conf: list[float]) -> list[int]:
        kept = prune_leaves(parents, path_conf, self.leaf_threshold)
        n_keep = self.max_nodes - 1
        if self.verify_cost is not None:
            conf = sorted((path_conf[v] for v in kept if v != 0), reverse=True)
            n_keep = min(n_keep, verified_tree_size(conf, self.verify_cost))
        return keep_most_confident(parents, path_conf, n_keep, among=kept)


@dataclass(frozen=True)
class _SharedForward:
    """t_B(m) = t(B m) / t(B): a stream's tree of m rows beside B - 1 streams drafting alike, relative to B rows."""

    t: Callable[[float], float]
    streams: int

    def __call__(self, m: float) -> float:
        return self.t(self.streams * m) / self.t(self.streams)


def verified_tree_size(conf: Sequence[float], verify_cost: Callable[[float], float]) -> int:
    """n* = argmax_n (1 + sum_{i <= n} f_(i)) / t(n + 1): how many of the most confident draft nodes to verify.

    conf: path confidences f, sorted descending (calibrated: f(v) estimates P(v accepted), so 1 + sum f is the
    expected tokens of a step, bonus included); t(m): a target forward over m rows (the root and n nodes) in
    single-row forwards. Worked example: f = [0.8, 0.6, 0.3, 0.1], t(1..5) = [1, 1.05, 1.1, 1.2, 1.6]:
    ratios 1, 1.71, 2.18, 2.25, 1.75 for n = 0..4 -> n* = 3.
    """
    best_n, best, tokens = 0, 1.0 / verify_cost(1), 1.0
    for n, f in enumerate(conf, start=1):
        tokens += f
        rate = tokens / verify_cost(n + 1)
        if rate > best:
            best_n, best = n, rate
    return best_n


@dataclass(frozen=True)
class VCTPolicy:
    """Vanilla Candidate Tree: the unpruned candidate tree that PCT prunes (Zheng & Wang, ACL 2025).

    Only the PCT paper's abstract was reachable, which describes PCT as pruning the redundant nodes of a
    candidate tree without defining that tree. Our choice: the EAGLE-style candidate tree before any
    pruning, expanding at every depth the ``width`` most confident frontier nodes by their top ``width``
    candidates. A full width-ary tree would have (width^(D+1) - 1) / (width - 1) nodes (364 for 3 and 5);
    the beam keeps it at 1 + width + (max_depth - 1) * width^2 nodes (40 for the defaults). Keeps everything.
    """

    width: int = 3
    max_depth: int = 5

    def __post_init__(self) -> None:
        _check_at_least("width", self.width, 1)
        _check_at_least("max_depth", self.max_depth, 1)

    @property
    def max_children(self) -> int:
        return self.width

    def frontier_to_expand(self, depth: int, path_conf: torch.Tensor) -> list[int]:
        return _beam_rows(depth, self.max_depth, path_conf, self.width)

    def expand(self, depth: int, path_conf: torch.Tensor, child_probs: torch.Tensor) -> list[tuple[int, int]]:
        return _beam_expand(depth, self.max_depth, path_conf, child_probs, self.width)

    def finalize(self, parents: list[int], path_conf: list[float]) -> list[int]:
        return list(range(len(parents)))


@dataclass(frozen=True)
class CAPEPolicy:
    """Confidence-aware proposal expansion (CaPE; Du et al., "GliDe with a CaPE", ICML 2024).

    The draft proposes a greedy chain; at each position the number of candidates (the greedy token plus
    alternatives) is set by the draft's top-1 probability there: low confidence, more candidates. The
    authors' released benchmark maps the decile of the top-1 probability to a count
    [8, 8, 8, 6, 6, 6, 4, 4, 2, 2, 2] (deciles 0..10), i.e. the default ``buckets``

        top-1 >= 0.8 -> 2,  >= 0.6 -> 4,  >= 0.3 -> 6,  else 8          (first bucket whose bound it meets)

    and drafts 4 positions (``max_depth=4``). With ``chain=True`` (the paper) only the greedy child continues
    (frontier index 0: the rank-0 child of the previous chain node) and alternatives stay leaves, so the tree
    has at most 1 + 4 * 8 = 33 nodes. ``chain=False`` is our tree generalisation: every frontier node is
    widened by its own bucket, each depth capped at max_nodes - 1 children and the tree at ``max_nodes``
    (root included) by the most confident nodes.
    """

    prunes_siblings: ClassVar[bool] = True  # keeps or drops siblings by their own draft probability

    buckets: tuple[tuple[float, int], ...] = ((0.8, 2), (0.6, 4), (0.3, 6), (0.0, 8))  # (lower bound, width)
    max_depth: int = 4
    max_nodes: int = 64  # root included
    chain: bool = True

    def __post_init__(self) -> None:
        bounds = [bound for bound, _ in self.buckets]
        if not bounds or bounds != sorted(set(bounds), reverse=True) or bounds[-1] != 0.0:
            raise ValueError(
                f"buckets must be (lower bound, width) pairs with strictly decreasing bounds ending at 0.0 "
                f"(so every confidence has a width), got {self.buckets}"
            )
        if any(width < 1 for _, width in self.buckets):
            raise ValueError(f"every bucket width must be >= 1, got {self.buckets}")
        _check_at_least("max_depth", self.max_depth, 1)
        _check_at_least("max_nodes", self.max_nodes, 1)
        object.__setattr__(self, "buckets", tuple((float(b), int(w)) for b, w in self.buckets))

    @property
    def max_children(self) -> int:
        return max(width for _, width in self.buckets)

    def width_for(self, top1: float) -> int:
        """Candidates at a position whose top-1 draft probability is ``top1``."""
        return next(width for bound, width in self.buckets if top1 >= bound)

    def frontier_to_expand(self, depth: int, path_conf: torch.Tensor) -> list[int]:
        if depth > self.max_depth or path_conf.numel() == 0:
            return []
        return [0] if self.chain else list(range(path_conf.numel()))

    def expand(self, depth: int, path_conf: torch.Tensor, child_probs: torch.Tensor) -> list[tuple[int, int]]:
        rows = self.frontier_to_expand(depth, path_conf)
        top1 = child_probs[:, 0].tolist() if rows else []  # host sync
        widths = {i: self.width_for(top1[i]) for i in rows}
        return _most_confident_children(path_conf, child_probs, widths, self.max_nodes - 1)

    def finalize(self, parents: list[int], path_conf: list[float]) -> list[int]:
        return keep_most_confident(parents, path_conf, self.max_nodes - 1)


@dataclass(frozen=True)
class EAGLE2Policy:
    """EAGLE-2 dynamic draft tree (Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic
    Draft Trees", 2024, section 4).

    Expansion: at each depth the ``top_k`` frontier nodes with the highest value V = f (the cumulative
    product of draft probabilities, i.e. cumulative log-probability) each get their top ``top_k`` children
    (depth 1: the root's top_k). Rerank: keep the ``total_tokens`` non-root nodes with the highest f, plus
    the root. f never increases along a path and ties go to the lower index (shallower: nodes are numbered
    breadth-first), so a kept node's parent always ranks ahead of it: the kept set is closed under ancestors.
    """

    prunes_siblings: ClassVar[bool] = True  # keeps or drops siblings by their own draft probability

    top_k: int = 8
    depth: int = 6  # draft depths below the root
    total_tokens: int = 60  # draft tokens kept by the rerank, root excluded

    def __post_init__(self) -> None:
        _check_at_least("top_k", self.top_k, 1)
        _check_at_least("depth", self.depth, 1)
        _check_at_least("total_tokens", self.total_tokens, 1)

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_children(self) -> int:
        return self.top_k

    def frontier_to_expand(self, depth: int, path_conf: torch.Tensor) -> list[int]:
        return _beam_rows(depth, self.depth, path_conf, self.top_k)

    def expand(self, depth: int, path_conf: torch.Tensor, child_probs: torch.Tensor) -> list[tuple[int, int]]:
        return _beam_expand(depth, self.depth, path_conf, child_probs, self.top_k)

    def finalize(self, parents: list[int], path_conf: list[float]) -> list[int]:
        return keep_most_confident(parents, path_conf, self.total_tokens)


# ---------------------------------------------------------------------------------------------------------
# Simulation and tree helpers


def grow(
    policy: TreePolicy, child_probs_of: Callable[[tuple[int, ...]], torch.Tensor]
) -> tuple[list[int], list[float]]:
    """Run ``policy`` the way a drafter would, with ``child_probs_of(path) -> (K',) sorted descending`` standing in
    for the draft (path: the ranks from the root). Returns the finalized tree renumbered breadth-first
    (parents with -1 for the root, siblings in rank order) and each node's path confidence f."""
    k = policy.max_children
    parents, conf, paths = [-1], [1.0], [()]
    frontier = [0]
    for depth in range(1, policy.max_depth + 1):
        path_conf = torch.tensor([conf[v] for v in frontier], dtype=torch.float64)  # (m,)
        rows = policy.frontier_to_expand(depth, path_conf)
        child_probs = torch.zeros(len(frontier), k, dtype=torch.float64)  # (m, K); unread rows stay 0
        for i in rows:
            child_probs[i] = _first_k(child_probs_of(paths[frontier[i]]), k)
        pairs = policy.expand(depth, path_conf, child_probs)
        check_expansion(pairs, rows, k)
        new_frontier = []
        for i, rank in pairs:
            node = frontier[i]
            parents.append(node)
            conf.append(conf[node] * float(child_probs[i, rank]))  # f(child) = f(parent) * p(rank)
            paths.append(paths[node] + (rank,))
            new_frontier.append(len(parents) - 1)
        if not new_frontier:
            break
        frontier = new_frontier
    keep = policy.finalize(parents, conf)
    return keep_subtree(parents, keep), [conf[v] for v in keep]


def check_expansion(pairs: Sequence[tuple[int, int]], rows: Sequence[int], k: int) -> None:
    """Raise unless ``pairs`` follows the expand conventions: frontier indices among ``rows`` (ascending groups),
    ranks 0, 1, ... without gaps within a group, every rank < k."""
    allowed = set(rows)
    last_row, last_rank = -1, -1
    for row, rank in pairs:
        expected = last_rank + 1 if row == last_row else 0
        if row not in allowed or row < last_row or rank != expected or rank >= k:
            raise ValueError(
                f"bad expansion {list(pairs)}: pairs must be grouped by frontier index ascending (indices among "
                f"{sorted(allowed)}), with ranks 0, 1, ... < {k} and no gaps within a group; broke at {(row, rank)}"
            )
        last_row, last_rank = row, rank


def bfs_order(parents: Sequence[int]) -> list[int]:
    """Renumber a parent list breadth-first, siblings in their original index order (rank order).

    Example: ``shapes.specinfer_tree(2, 3)`` numbers each sequence depth-first, [-1, 0, 1, 2, 0, 4, 5];
    breadth-first it is [-1, 0, 0, 1, 2, 3, 4] (the same two chains).
    """
    _check_parents(parents)
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    order = [0]
    for node in order:  # the list grows while we walk it: a queue
        order.extend(children[node])
    new_index = {old: new for new, old in enumerate(order)}
    return [-1] + [new_index[parents[old]] for old in order[1:]]


def keep_subtree(parents: Sequence[int], keep: Sequence[int]) -> list[int]:
    """Parents of the kept nodes, renumbered by position in ``keep`` (which must be sorted, contain the root
    and be closed under ancestors). A breadth-first tree stays breadth-first."""
    _check_parents(parents)
    position = {node: i for i, node in enumerate(keep)}
    if not keep or keep[0] != 0 or list(keep) != sorted(position) or len(position) != len(keep):
        raise ValueError(f"kept nodes must be sorted, distinct and start with the root 0, got {list(keep)}")
    if any(parents[node] not in position for node in keep[1:]):
        raise ValueError(f"kept nodes {list(keep)} are not closed under ancestors for parents {list(parents)}")
    return [-1] + [position[parents[node]] for node in keep[1:]]


def prune_leaves(parents: Sequence[int], path_conf: Sequence[float], threshold: float) -> list[int]:
    """Drop leaves with f < threshold, repeatedly (a parent left childless is then a leaf), never the root."""
    _check_parents(parents)
    keep = [True] * len(parents)
    has_kept_child = [False] * len(parents)
    for node in range(len(parents) - 1, 0, -1):  # children come after their parents
        if not has_kept_child[node] and path_conf[node] < threshold:
            keep[node] = False
        else:
            has_kept_child[parents[node]] = True
    return [node for node, kept in enumerate(keep) if kept]


def keep_most_confident(
    parents: Sequence[int], path_conf: Sequence[float], n_keep: int, among: Sequence[int] | None = None
) -> list[int]:
    """The root plus the ``n_keep`` non-root nodes (of ``among``, itself ancestor-closed; default all) with the
    highest f, sorted. Ranked by (-f', index) with f'(v) = min of f over v's path: a parent has f' >= its
    child's and a lower index (shallower, in breadth-first numbering), so it always outranks the child and the
    result is closed under ancestors, ties and non-monotone f included."""
    _check_parents(parents)
    score = list(path_conf)
    for node in range(1, len(parents)):
        score[node] = min(score[node], score[parents[node]])
    candidates = [node for node in (range(len(parents)) if among is None else among) if node != 0]
    ranked = sorted(candidates, key=lambda node: (-score[node], node))
    return sorted([0, *ranked[: max(n_keep, 0)]])


def _most_confident_children(
    path_conf: torch.Tensor, child_probs: torch.Tensor, widths: dict[int, int], cap: int
) -> list[tuple[int, int]]:
    """Ranks 0..widths[i]-1 of each frontier row i, cut to the ``cap`` children of highest f = f(i) * p(i, r).

    The cut keeps a count per row and re-emits ranks 0..count-1, so the result is gap-free even if a row were
    not sorted. Ties go to the lower (row, rank)."""
    if not widths:
        return []
    f = path_conf.tolist()  # host sync: the tree shape is decided on the CPU
    p = child_probs.tolist()
    k = child_probs.shape[1]
    candidates = [(f[i] * p[i][rank], i, rank) for i in sorted(widths) for rank in range(min(widths[i], k))]
    best = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[: max(cap, 0)]
    count = {i: 0 for i in widths}
    for _, i, _ in best:
        count[i] += 1
    return [(i, rank) for i in sorted(count) for rank in range(count[i])]


def _beam_rows(depth: int, max_depth: int, path_conf: torch.Tensor, width: int) -> list[int]:
    """VCT / EAGLE-2 expansion: the ``width`` most confident frontier rows, until ``max_depth``."""
    if depth > max_depth:
        return []
    return _most_confident_rows(path_conf.tolist(), width)  # host sync


def _beam_expand(
    depth: int, max_depth: int, path_conf: torch.Tensor, child_probs: torch.Tensor, width: int
) -> list[tuple[int, int]]:
    """The top ``width`` children of each of the ``width`` most confident frontier nodes."""
    ranks = min(width, child_probs.shape[1])
    return [(i, rank) for i in _beam_rows(depth, max_depth, path_conf, width) for rank in range(ranks)]


def _most_confident_rows(path_conf: list[float], n: int) -> list[int]:
    """Indices of the n highest path confidences (ties: lower index), ascending."""
    ranked = sorted(range(len(path_conf)), key=lambda i: (-path_conf[i], i))
    return sorted(ranked[:n])


def _first_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """The first k entries of a descending probability vector, zero-padded: (K',) -> (k,)."""
    probs = probs.reshape(-1).to(torch.float64)[:k]
    return torch.cat([probs, probs.new_zeros(k - probs.numel())])


def _depths(parents: Sequence[int]) -> list[int]:
    depth = [0] * len(parents)
    for node in range(1, len(parents)):
        depth[node] = depth[parents[node]] + 1
    return depth


def _check_parents(parents: Sequence[int]) -> None:
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents[1:], start=1)):
        raise ValueError(
            f"parents must start with the root (-1) and name an earlier node for every other, got {parents}"
        )


def _check_at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
