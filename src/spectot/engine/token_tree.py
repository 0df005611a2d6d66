"""TokenTree: the tokens one target forward appends to one stream, and how they hang together.

Node 0 is the root: the stream's pending token (sampled but not yet run through the model), whose
parent is the stream's committed context. Every other node's parent comes earlier in the list.
A chain (plain speculative decoding, a prefill) is the tree with ``parents = [-1, 0, 1, ...]``.

Worked example, a stream of 7 committed tokens and the tree

        t0            tokens  = [t0, a, b, c]
       /  \\          parents = [-1, 0, 0, 1]
      a    b          depths  = [0, 1, 1, 2]
      |               positions = 7 + depths = [7, 8, 8, 9]
      c               ancestors (row i sees column j):  t0: t0 / a: t0 a / b: t0 b / c: t0 a c
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class TokenTree:
    tokens: torch.Tensor  # (n,) int64
    parents: torch.Tensor  # (n,) int64, parents[0] == -1, parents[i] < i
    is_chain: bool = field(init=False)  # parents = [-1, 0, 1, ...]
    depth: int = field(init=False)  # the deepest node's depth (n - 1 for a chain)

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        parents = self.parents.tolist()
        if n == 0 or len(parents) != n or parents[0] != -1:
            raise ValueError(f"a token tree needs a root with parent -1 and one parent per token, got {parents}")
        if any(not 0 <= p < i for i, p in enumerate(parents[1:], start=1)):
            raise ValueError(f"every parent must be an earlier node: parents={parents}")
        object.__setattr__(self, "is_chain", parents == list(range(-1, n - 1)))
        object.__setattr__(self, "depth", n - 1 if self.is_chain else max(self._depth_list))

    # depths and ancestors are built when first read: the runner's chain paths (an AR step, a draft's
    # one-node step) need neither, and building them was a third of such a step's tree overhead
    @cached_property
    def _depth_list(self) -> list[int]:
        parents = self.parents.tolist()
        depths = [0] * len(parents)
        for i, p in enumerate(parents[1:], start=1):
            depths[i] = depths[p] + 1
        return depths

    @cached_property
    def depths(self) -> torch.Tensor:
        """(n,) int64: each node's depth below the root."""
        return torch.arange(len(self)) if self.is_chain else torch.tensor(self._depth_list)

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """(n, n) bool, ancestor-or-self: row i sees column j."""
        n = len(self)
        if self.is_chain:
            return torch.ones(n, n, dtype=torch.bool).tril_()
        ancestors = torch.eye(n, dtype=torch.bool)
        if n <= 16:  # a row inherits its parent's row: row by row for small trees,
            for i, p in enumerate(self.parents.tolist()[1:], start=1):
                ancestors[i] |= ancestors[p]
        else:  # level by level for large ones
            depth_of = self.depths
            for d in range(1, self.depth + 1):
                level = (depth_of == d).nonzero().squeeze(1)
                ancestors[level] |= ancestors[self.parents[level]]
        return ancestors

    @classmethod
    def chain(cls, tokens: torch.Tensor | list[int]) -> TokenTree:
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        return cls(tokens, torch.arange(-1, tokens.numel() - 1, dtype=torch.int64))

    def __len__(self) -> int:
        return self.tokens.numel()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().squeeze(1).tolist()
