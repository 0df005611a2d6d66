"""Token-tree verification: walk from the root, at each node try its children, emit the accepted path
plus one recovered/bonus token. Every rule is lossless: the emitted tokens follow the target.

p[u]: target probabilities after node u's path (row u of the tree forward). q[u]: the draft
distribution u's children were drawn from. The rules differ in how the children were drawn:

- ``greedy``: target argmax; follow the child equal to it.
- ``with_replacement`` (SpecInfer, Miao et al. 2024; MCSD with replacement, Yang et al. 2024):
  children are i.i.d. draws from q. Try them in order: accept x with min(1, p(x)/q(x)); on
  rejection p <- norm(max(p - q, 0)), q unchanged.
- ``without_replacement`` (Sequoia, Chen et al. 2024; MCSD without replacement): children are
  distinct draws from q without replacement. On rejection of x: p <- norm(max(p - q, 0)), then
  q(x) <- 0 and q <- norm(q). When q has no mass left, the children still to try were not drawn from
  anything (the draft's top-k of q / E had run out of support and took zero-q tokens in a fixed order):
  they are tried as the deterministic candidates they are, one-hot q each. (Treating them as uniform draws
  over the tokens not yet rejected, as this rule once did, never emitted a token outside q's support that
  p gives mass: q = [.6, .4, 0, ...] with 3 children lost token 2's p = 0.2 entirely.)
- ``deterministic`` (top-k drafts, n-gram): one-hot q per child; the rule above with q = onehot(x)
  accepts some child with probability sum of p over the children. The decoder verifies such trees
  with the coupled rule instead (``verify_tree_coupled``): the same acceptance, and plain decoding's
  output token for token.
- ``naive``: draw y ~ p; accept the child equal to y if there is one, else emit y.

Worked example (greedy): tokens [t0, a, b, c], parents [-1, 0, 0, 1], target argmax after t0 is b,
after b is z: b is accepted (node 2), b has no child z, so the path is [0, 2] and the next token z.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from spectot.engine.token_tree import TokenTree
from spectot.spec.sampling import sample
from spectot.spec.verify import residual

TreeRule = Literal["greedy", "with_replacement", "without_replacement", "deterministic", "naive"]


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted node indices, root first (the root is always kept)
    next_token: int  # recovered or bonus token after the path

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify_tree_greedy(tree: TokenTree, target_argmax: torch.Tensor) -> TreeVerdict:
    """``target_argmax``: (n,) argmax of p at every node."""
    return verify_tree_coupled(tree, lambda node: int(target_argmax[node]))


def verify_tree_coupled(tree: TokenTree, target_token: Callable[[int], int]) -> TreeVerdict:
    """Follow the child equal to the target's token at each node, ``target_token(node)``: its argmax
    (greedy), or argmax p / E with the stream's own noise E for that node's depth (``sampling.sample_at``),
    which makes a sampled tree emit exactly what plain decoding samples (the coupled rule of
    ``verify.verify_chain_coupled``, for deterministic children)."""
    children = _children(tree)
    node, path = 0, [0]
    while True:
        want = target_token(node)
        nxt = next((c for c in children[node] if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return TreeVerdict(path, want)
        node = nxt
        path.append(node)


def verify_tree(
    tree: TokenTree,
    p: torch.Tensor,  # (n, V) target probabilities at every node
    q: torch.Tensor | None,  # (n, V) draft distribution each node's children came from; None: one-hot
    rule: TreeRule,
    generator: torch.Generator | None,
) -> TreeVerdict:
    if rule == "greedy":
        return verify_tree_greedy(tree, p.argmax(-1))
    children = _children(tree)
    node, path = 0, [0]
    while True:
        kids = children[node]
        if rule == "naive":
            y = int(sample(p[node], generator))
            nxt = next((c for c in kids if int(tree.tokens[c]) == y), None)
            if nxt is None:
                return TreeVerdict(path, y)
        else:
            q_node = None if q is None or rule == "deterministic" else q[node]
            nxt, p_left = _try_children(tree, kids, p[node], q_node, rule, generator)
            if nxt is None:
                return TreeVerdict(path, int(sample(p_left, generator)))
        node = nxt
        path.append(node)


def _try_children(
    tree: TokenTree,
    kids: list[int],
    p: torch.Tensor,  # (V,)
    q: torch.Tensor | None,  # (V,) or None for one-hot children
    rule: TreeRule,
    generator: torch.Generator | None,
) -> tuple[int | None, torch.Tensor]:
    """Multi-candidate speculative sampling at one node: the accepted child, or None and the
    residual target distribution to sample the recovered token from."""
    rejected = torch.zeros_like(p, dtype=torch.bool)
    for child in kids:
        x = int(tree.tokens[child])
        q_x = 0.0 if q is None else float(q[x])
        fixed = q_x <= 0  # one-hot children, or a child q could not have drawn: a fixed candidate, q(x) = 1
        q_now = torch.zeros_like(p).index_fill_(0, torch.tensor([x]), 1.0) if fixed else q
        u = float(torch.rand((), generator=generator))
        if u * (1.0 if fixed else q_x) < float(p[x]):  # accept with min(1, p(x) / q(x))
            return child, p
        p = residual(p, q_now)
        if rule == "without_replacement" and q is not None:
            rejected[x] = True
            q = q.masked_fill(rejected, 0.0)
            total = float(q.sum())
            q = q / total if total > 0 else None  # support exhausted: the rest are fixed candidates
    return None, p


def _children(tree: TokenTree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(tree))]
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        kids[parent].append(node)
    return kids
