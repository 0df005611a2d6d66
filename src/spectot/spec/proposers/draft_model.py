"""An independent draft model with the target's tokenizer, run in its own ModelRunner.

The draft keeps one KV stream per decoding stream and remembers which tokens it has run. Before
drafting it rolls back to the longest common prefix with the stream's real tokens (rejected
drafts go away) and runs the rest as one chain, then drafts k tokens one forward at a time. All
streams draft together: each draft forward is one batched forward over every stream. Near the end
of the draft's own context it proposes fewer tokens, then none (the target decodes on alone).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.spec.proposers.base import Draft, DraftRequest
from spectot.spec.sampling import SamplingParams, sample, target_probs


def common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return n if differ.numel() == 0 else int(differ[0])


class DraftModelProposer:
    """``tokens``: the ids that are real tokens (the tokenizer's; None: every row of the draft's head) and
    ``target_rows``: the rows of the target's head (None: the draft's). A draft whose head is padded to another width
    than the target's (Qwen2.5-0.5B's 151,936 rows against 7B's 152,064, one tokenizer) drafts from its rows of
    real tokens only, and its q is laid out on the target's rows (0 on the padding): verification stays exact."""

    def __init__(
        self, runner: ModelRunner, name: str = "model", tokens: int | None = None, target_rows: int | None = None
    ) -> None:
        if tokens is not None and target_rows is not None and tokens > target_rows:  # padding q would crop it
            raise ValueError(f"the draft's {tokens} real tokens do not fit the target's {target_rows} head rows")
        self.runner = runner
        self.name = name
        self.tokens, self.target_rows = tokens, target_rows  # (not ``width``: that names an n-gram tree's width)
        self.forwards = 0
        self._streams: dict[int, int] = {}  # decoding key -> draft KV stream
        self._fed: dict[int, torch.Tensor] = {}  # decoding key -> tokens whose KV the draft holds

    def propose(
        self, requests: Sequence[DraftRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Draft]:
        drafted: dict[int, list[int]] = {r.key: [] for r in requests}
        probs: dict[int, list[torch.Tensor]] = {r.key: [] for r in requests}
        room = {r.key: self.runner.max_context - r.tokens.numel() for r in requests}  # the draft's own context
        active = [r for r in requests if min(r.k, room[r.key]) > 0]
        chains = {r.key: TokenTree.chain(self._catch_up(r)) for r in active}
        while active:  # one batched draft forward per drafted position
            out = self.runner.forward([StreamTree(self._streams[r.key], chains[r.key]) for r in active], last_only=True)
            self.runner.commit_all()
            self.forwards += 1
            still_drafting = []
            for r, logits in zip(active, out.logits):
                self._fed[r.key] = torch.cat([self._fed[r.key], chains[r.key].tokens])
                q = target_probs(logits[0, : self.tokens], params)  # (V,) over the real tokens
                token = int(q.argmax() if params.greedy else sample(q, r.generator or generator))
                drafted[r.key].append(token)
                probs[r.key].append(self._on_target_rows(q))
                if len(drafted[r.key]) < min(r.k, room[r.key]):
                    chains[r.key] = TokenTree.chain([token])
                    still_drafting.append(r)
            active = still_drafting
        return [
            Draft(torch.tensor(drafted[r.key], dtype=torch.int64), None)
            if params.greedy or not drafted[r.key]
            else Draft(torch.tensor(drafted[r.key], dtype=torch.int64), torch.stack(probs[r.key]))
            for r in requests
        ]

    def _on_target_rows(self, q: torch.Tensor) -> torch.Tensor:
        """q laid out on the target's head rows: zeros past the real tokens."""
        if self.target_rows is None or self.target_rows == q.numel():
            return q
        return torch.nn.functional.pad(q, (0, self.target_rows - q.numel()))

    def _catch_up(self, r: DraftRequest) -> torch.Tensor:
        """Roll the draft's stream back to its common prefix with the real tokens; return the
        tokens it still has to run (at least the last one, whose logits predict the next)."""
        if r.key not in self._streams:
            self._streams[r.key] = self.runner.new_stream()
            self._fed[r.key] = r.tokens[:0]
        keep = min(common_prefix_len(self._fed[r.key], r.tokens), r.tokens.numel() - 1)
        self.runner.truncate(self._streams[r.key], keep)
        self._fed[r.key] = self._fed[r.key][:keep]
        return r.tokens[keep:]

    def release(self, key: int, keep: bool = True) -> None:
        if key in self._streams:
            self.runner.release(self._streams.pop(key))
            del self._fed[key]
