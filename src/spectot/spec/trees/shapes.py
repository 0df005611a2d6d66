"""Static token-tree shapes, as parent lists (node 0 is the root; parents[0] == -1).

A shape says where draft tokens go, not which tokens: a proposer fills it. Children of a node are
listed in draft rank order (the first child is the draft's most likely token), which is what the
positional acceptance model of the Sequoia DP (``sequoia.py``) assumes.

Worked example, ``k_config_tree((2, 1))`` (MCSD / SEED: 2 candidates at depth 1, 1 under each):

        0             parents = [-1, 0, 0, 1, 2]
       / \\            depths  = [0, 1, 1, 2, 2]
      1   2
      |   |
      3   4
"""

from __future__ import annotations

from collections.abc import Sequence


def chain_tree(k: int) -> list[int]:
    """Root plus k tokens in a line: plain speculative decoding."""
    _check_positive("k", k)
    return [-1] + list(range(k))


def fan_chain_tree(width: int, k: int) -> list[int]:
    """``width`` candidates at depth 1 and a chain of k - 1 more below the first: the adaptive draft length's
    trees (``spec/draft_length.py``), the first token's runners-up where the draft's first guess often misses.
    fan_chain_tree(3, 3) = [-1, 0, 0, 0, 1, 4]; fan_chain_tree(1, k) = chain_tree(k)."""
    _check_positive("width", width)
    _check_positive("k", k)
    parents = [-1] + [0] * width
    if k > 1:
        parents += [1] + list(range(width + 1, width + k - 1))
    return parents


def k_config_tree(k_config: Sequence[int]) -> list[int]:
    """MCSD / SEED: every node at depth d - 1 gets k_config[d - 1] children (all nodes expanded)."""
    if not k_config or any(k < 1 for k in k_config):
        raise ValueError(f"k_config needs at least one depth and k >= 1 at every depth, got {tuple(k_config)}")
    parents, frontier = [-1], [0]
    for k in k_config:
        next_frontier = []
        for node in frontier:
            for _ in range(k):
                parents.append(node)
                next_frontier.append(len(parents) - 1)
        frontier = next_frontier
    return parents


def k_ary_tree(k: int, depth: int) -> list[int]:
    """Full k-ary tree of the given depth (k_config of depth copies of k)."""
    _check_positive("depth", depth)
    return k_config_tree([k] * depth)


def specinfer_tree(k: int, length: int) -> list[int]:
    """SpecInfer: k independent draft sequences of ``length`` tokens sharing only the root."""
    _check_positive("k", k)
    _check_positive("length", length)
    parents = [-1]
    for _ in range(k):
        parents.append(0)
        parents.extend(range(len(parents) - 1, len(parents) - 1 + length - 1))
    return parents


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
