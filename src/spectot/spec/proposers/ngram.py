"""Prompt-lookup drafts (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): no model.

If the last n tokens occurred earlier in the stream (prompt or generated text), propose what
followed their latest earlier occurrence. Tries n = max_ngram down to min_ngram. The draft is
deterministic, so it is verified with a one-hot q. With ``width`` > 1 the continuations of the
``width`` latest distinct matches are merged into a token tree (a trie; the latest match ranks first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spectot.spec.proposers.base import Draft, DraftRequest
from spectot.spec.sampling import SamplingParams


def lookup_match(tokens: torch.Tensor, k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[torch.Tensor, int]:
    """(L,) tokens -> up to k tokens that followed the latest earlier match of the trailing n-gram, and the
    length n of that n-gram (0: none). A longer match is stronger evidence: the adaptive draft length tracks
    acceptance by n (``spec/draft_length.py``).

    Example: tokens = [5, 6, 7, 9, 5, 6], k = 2: the trailing [5, 6] occurred at 0, so ([7, 9], 2).
    """
    n_tokens = tokens.numel()
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        windows = tokens[: n_tokens - 1].unfold(0, n, 1)  # (L - n, n): every n-gram that has a successor
        hits = (windows == tokens[n_tokens - n :]).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # host sync: the match position picks the slice
            return tokens[start : start + k], n
    return tokens[:0], 0


def lookup_continuations(
    tokens: torch.Tensor, k: int, width: int, max_ngram: int = 3, min_ngram: int = 1
) -> list[torch.Tensor]:
    """Up to ``width`` distinct continuations (k tokens at most) of the trailing n-gram's earlier
    matches, latest first; the longest n with any match wins."""
    n_tokens = tokens.numel()
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        windows = tokens[: n_tokens - 1].unfold(0, n, 1)
        hits = (windows == tokens[n_tokens - n :]).all(1).nonzero().squeeze(1).tolist()  # host sync
        found: dict[tuple[int, ...], torch.Tensor] = {}
        for start in reversed(hits):
            continuation = tokens[start + n : start + n + k]
            found.setdefault(tuple(continuation.tolist()), continuation)
            if len(found) == width:
                break
        if found:
            return list(found.values())
    return []


def graft(tokens: list[int], parents: list[int], branch: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Hang the chain ``branch`` from the root of the tree (tokens, parents; -1 = the root), sharing the
    nodes it agrees with: (tokens, parents, the node of each branch token). Nodes from ``len(tokens)`` on are new.

    Example: tokens [5, 6, 7], parents [-1, 0, 1] (a chain), branch [5, 8, 9]
    -> tokens [5, 6, 7, 8, 9], parents [-1, 0, 1, 0, 3], path [0, 3, 4] (3 and 4 new).
    """
    tokens, parents, path = list(tokens), list(parents), []
    node_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    parent = -1
    for token in branch:
        if (parent, token) not in node_of:
            node_of[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
        parent = node_of[(parent, token)]
        path.append(parent)
    return tokens, parents, path


def trie(continuations: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge token sequences into a tree: (tokens, parents) with -1 = the root they hang from.

    Example: [5, 6], [5, 7], [8] -> tokens [5, 6, 7, 8], parents [-1, 0, 0, -1].
    """
    tokens: list[int] = []
    parents: list[int] = []
    for seq in continuations:
        tokens, parents, _ = graft(tokens, parents, seq.tolist())
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64)


@dataclass
class NgramProposer:
    max_ngram: int = 3
    min_ngram: int = 1
    width: int = 1  # > 1: a tree of the latest `width` distinct continuations
    name: str = "ngram"
    forwards: int = 0
    reports_match: bool = True  # a lookup costs the same for any k: draft in full, cut by Draft.match after

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.width < 1:
            raise ValueError(f"the n-gram tree width must be >= 1, got {self.width}")

    def propose(
        self, requests: Sequence[DraftRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Draft]:
        if self.width == 1:
            matches = [lookup_match(r.tokens, r.k, self.max_ngram, self.min_ngram) for r in requests]
            return [Draft(tokens, None, match=n) for tokens, n in matches]
        drafts = []
        for r in requests:
            found = lookup_continuations(r.tokens, r.k, self.width, self.max_ngram, self.min_ngram)
            tokens, parents = trie(found)
            drafts.append(Draft(tokens, None, parents) if len(found) > 1 else Draft(tokens, None))
        return drafts

    def release(self, key: int, keep: bool = True) -> None:
        pass
