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

from spectot.engine.token_tree import TokenTree
from spectot.spec.sampling import CoupledNoise, SamplingParams
from spectot.spec.tree_verify import TreeRule
from spectot.spec.trees.dynamic import TreePolicy


@dataclass(frozen=True)
class DraftRequest:
    key: int  # the decoding stream this draft is for; proposers may keep state per key
    tokens: torch.Tensor  # (L,) int64: prompt + generated so far, including the pending token
    k: int  # how many tokens to propose at most (a tree: its depth at most)
    hidden: torch.Tensor | None = None  # (m, H) target hidden states of the tokens committed since the last request
    generator: torch.Generator | None = None  # the stream's own random source (else the propose call's)
    policy: TreePolicy | None = None  # the tree to grow for this stream (else the proposer's own)
    # a sampling stream's noise E_j (``noise.at(j, ids)``: its values at the draft's token ids): a deterministic
    # draft that guesses token j as argmax q / E_j matches the target's own draw more often than its argmax
    # does; None under greedy decoding
    noise: CoupledNoise | None = None
    position: int = 0  # j of the draft's first token (tokens generated so far)
    streams: int = 0  # the streams sharing the target forward this draft is verified in (0: the propose call's)


@dataclass(frozen=True)
class Draft:
    """Draft tokens for one stream: a chain, or a tree when ``parents`` is given.

    Tree example: tokens [a, b, c], parents [-1, -1, 0] -> a and b are alternatives for the next
    token (children of the pending token), c follows a. ``q[i]`` is the distribution token i was
    drawn from (all children of one node share it); ``rule`` says how siblings were drawn
    (``spec/tree_verify.py``). Without q the tokens are deterministic (top-k, n-gram): one-hot q.
    """

    tokens: torch.Tensor  # (k',) int64 (may be empty: nothing worth verifying)
    q: torch.Tensor | None  # (k', V) float32 draft probabilities, None = deterministic (one-hot)
    parents: torch.Tensor | None = None  # (k',) int64 parent within the draft, -1 = the pending token
    rule: TreeRule | None = None  # sampled trees: "with_replacement" or "without_replacement"
    confidence: torch.Tensor | None = None  # (k',) draft probability of each token given its parent (calibration)
    match: int | None = None  # a free draft's evidence class (prompt lookup: matched n-gram length), see `cut`

    def __post_init__(self) -> None:
        if (
            self.parents is not None
            and self.q is not None
            and self.rule not in ("with_replacement", "without_replacement")
        ):
            raise ValueError("a sampled tree draft needs rule='with_replacement' or 'without_replacement'")

    def node_q(self) -> torch.Tensor | None:
        """(k'+1, V): row u = the distribution node u's children were drawn from (root = node 0)."""
        if self.q is None or self.parents is None:
            return None
        rows = torch.zeros(self.tokens.numel() + 1, self.q.shape[1])
        rows[self.parents + 1] = self.q
        return rows

    def cut(self, k: int) -> Draft:
        """The chain's first k tokens (a chain is lossless at any length chosen before verification)."""
        if self.parents is not None:
            raise ValueError("only a chain draft can be cut to a length")
        q = None if self.q is None else self.q[:k]
        confidence = None if self.confidence is None else self.confidence[:k]
        return Draft(self.tokens[:k], q, confidence=confidence, match=self.match)

    @classmethod
    def empty(cls) -> Draft:
        return cls(torch.empty(0, dtype=torch.int64), None)

    def tree(self, root: int) -> TokenTree:
        """The verification tree: the pending token ``root`` with this draft below it."""
        tokens = torch.cat([torch.tensor([root], dtype=torch.int64), self.tokens])
        if self.parents is None:
            return TokenTree.chain(tokens)
        return TokenTree(tokens, torch.cat([torch.tensor([-1]), self.parents + 1]))


class Proposer(Protocol):
    name: str
    forwards: int  # draft model forwards so far (0 for model-free proposers)

    def propose(
        self, requests: Sequence[DraftRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Draft]: ...

    def release(self, key: int, keep: bool = True) -> None:
        """The stream is finished: drop any state kept for it (``keep``: a draft cache may keep it for later
        prompts; not after a failed step)."""


def drafts_chains(proposer: Proposer | None) -> bool:
    """Whether the proposer drafts a chain of the request's k tokens (no tree of its own: no tree policy,
    no n-gram width)."""
    return proposer is not None and getattr(proposer, "policy", None) is None and getattr(proposer, "width", 1) == 1
