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

import torch


@dataclass(frozen=True)
class TokenTree:
    tokens: torch.Tensor  # (n,) int64
    parents: torch.Tensor  # (n,) int64, parents[0] == -1, parents[i] < i
    depths: torch.Tensor = field(init=False)  # (n,) int64
    ancestors: torch.Tensor = field(init=False)  # (n, n) bool, ancestor-or-self
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
        if self.is_chain:
            object.__setattr__(self, "depth", n - 1)  # a prefill, an AR step, a chain draft: no loop
            object.__setattr__(self, "depths", torch.arange(n))
            object.__setattr__(self, "ancestors", torch.ones(n, n, dtype=torch.bool).tril_())
            return
        depths = [0] * n
        for i, p in enumerate(parents[1:], start=1):
            depths[i] = depths[p] + 1
        ancestors = torch.eye(n, dtype=torch.bool)
        depth_of = torch.tensor(depths)
        if n <= 16:  # a row inherits its parent's row: row by row for small trees,
            for i, p in enumerate(parents[1:], start=1):
                ancestors[i] |= ancestors[p]
        else:  # level by level for large ones
            for d in range(1, max(depths) + 1):
                level = (depth_of == d).nonzero().squeeze(1)
                ancestors[level] |= ancestors[self.parents[level]]
        object.__setattr__(self, "depths", depth_of)
        object.__setattr__(self, "depth", max(depths))
        object.__setattr__(self, "ancestors", ancestors)

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
