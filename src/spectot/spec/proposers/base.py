"""The proposer interface: given each stream's tokens so far, propose draft tokens.

A proposer is anything that guesses the target's continuation: an independent draft model, an
n-gram lookup, later a token-tree drafter or EDD. It returns the draft tokens and the distribution
q each was drawn from (None when the draft is deterministic, which verification treats as one-hot:
a greedy or n-gram draft verified against its real logits would not be lossless).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from spectot.spec.sampling import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    key: int  # the decoding stream this draft is for; proposers may keep state per key
    tokens: torch.Tensor  # (L,) int64: prompt + generated so far, including the pending token
    k: int  # how many tokens to propose at most


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # (k',) int64, k' <= k (may be empty: nothing worth verifying)
    q: torch.Tensor | None  # (k', V) float32 draft probabilities, None = deterministic (one-hot)

    @classmethod
    def empty(cls) -> Draft:
        return cls(torch.empty(0, dtype=torch.int64), None)


class Proposer(Protocol):
    name: str
    forwards: int  # draft model forwards so far (0 for model-free proposers)

    def propose(
        self, requests: Sequence[DraftRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Draft]: ...

    def release(self, key: int) -> None:
        """The stream is finished: drop any state kept for it."""
