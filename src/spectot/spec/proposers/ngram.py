"""Prompt-lookup drafts (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): no model.

If the last n tokens occurred earlier in the stream (prompt or generated text), propose what
followed their latest earlier occurrence. Tries n = max_ngram down to min_ngram. The draft is
deterministic, so it is verified with a one-hot q.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spectot.spec.proposers.base import Draft, DraftRequest
from spectot.spec.sampling import SamplingParams


def lookup_continuation(tokens: torch.Tensor, k: int, max_ngram: int = 3, min_ngram: int = 1) -> torch.Tensor:
    """(L,) tokens -> up to k tokens that followed the latest earlier match of the trailing n-gram.

    Example: tokens = [5, 6, 7, 9, 5, 6], k = 2: the trailing [5, 6] occurred at 0, so propose [7, 9].
    """
    n_tokens = tokens.numel()
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        windows = tokens[: n_tokens - 1].unfold(0, n, 1)  # (L - n, n): every n-gram that has a successor
        hits = (windows == tokens[n_tokens - n :]).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # host sync: the match position picks the slice
            return tokens[start : start + k]
    return tokens[:0]


@dataclass
class NgramProposer:
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "ngram"
    forwards: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(
        self, requests: Sequence[DraftRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Draft]:
        return [
            Draft(lookup_continuation(r.tokens, r.k, self.max_ngram, self.min_ngram), None) for r in requests
        ]

    def release(self, key: int) -> None:
        pass
