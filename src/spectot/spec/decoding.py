"""The decoding loop: ``ar`` (the baseline) and ``sd`` (chain speculative decoding) for a batch of
streams, every step one target forward over all of them.

Each stream holds its committed tokens in the target's KV cache plus one *pending* token (sampled,
not yet run). A step is: propose drafts (sd) -> one batched forward over each stream's chain
[pending, x_1..x_k] -> verify -> commit the accepted path -> emit accepted + recovered/bonus tokens,
cut at EOS, stop strings or max_new_tokens. A draft may be a token tree (``Draft.parents``): the
forward then covers the tree and verification follows the accepted root-to-leaf path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.spec.proposers.base import Draft, DraftRequest, Proposer
from spectot.spec.sampling import SamplingParams, sample, target_probs
from spectot.spec.stats import DecodeStats
from spectot.spec.tree_verify import verify_tree
from spectot.spec.verify import verify_chain, verify_chain_greedy

Method = Literal["ar", "sd"]
FinishReason = Literal["eos", "stop", "length"]


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    method: Method = "ar"
    num_draft_tokens: int = 5  # k: draft tokens per verification (sd)
    stop: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")


@dataclass
class StreamResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens (an EOS that ended the stream included)
    finish_reason: FinishReason
    stats: DecodeStats


@dataclass
class _Stream:
    key: int
    sid: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    finish: FinishReason | None = None
    unseen_hidden: list[torch.Tensor] = field(default_factory=list)  # target hidden states not yet given to the draft

    @property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.prompt + self.generated, dtype=torch.int64)


class Decoder:
    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: Sequence[int] = (),
        proposer: Proposer | None = None,
        detokenize: Callable[[list[int]], str] | None = None,  # needed for stop strings
    ) -> None:
        self.runner = runner
        self.eos = frozenset(eos_token_ids)
        self.proposer = proposer
        self.detokenize = detokenize

    @property
    def hidden_layer(self) -> int | None:
        """The target layer whose hidden states of verified tokens the draft reads (EDD), if any."""
        return getattr(self.proposer, "hidden_layer", None)

    def generate(self, prompts: Sequence[Sequence[int]], config: DecodeConfig) -> list[StreamResult]:
        if config.method == "sd" and self.proposer is None:
            raise ValueError("method 'sd' needs a draft: pass a proposer (a draft model or ngram)")
        if config.stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenizer")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        for i, p in enumerate(prompts):
            if len(p) + config.max_new_tokens > self.runner.max_context:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={config.max_new_tokens} it exceeds the "
                    f"model's context of {self.runner.max_context} tokens"
                )
        generator = torch.Generator().manual_seed(config.seed)
        batch = DecodeStats()
        t0 = time.perf_counter()
        streams = [_Stream(i, self.runner.new_stream(), list(p)) for i, p in enumerate(prompts)]
        try:
            self._prefill(streams, config, generator, batch)
            active = [s for s in streams if s.finish is None]
            while active:
                self._step(active, config, generator, batch)
                active = [s for s in active if s.finish is None]
        finally:
            self.runner.abort()  # an error mid-step must not leave a forward pending
            for s in streams:
                self.runner.release(s.sid)
                if self.proposer is not None:
                    self.proposer.release(s.key)
        batch.time_total = time.perf_counter() - t0
        return [self._result(s, batch) for s in streams]

    # -- phases ----------------------------------------------------------------------------
    def _prefill(self, streams: list[_Stream], config: DecodeConfig, generator, batch: DecodeStats) -> None:
        """Run every prompt but its last token's successor; the first new token becomes pending."""
        trees = [StreamTree(s.sid, TokenTree.chain(s.prompt)) for s in streams]
        out = self.runner.forward(trees, last_only=True, hidden_layer=self._hidden_layer(config))
        self.runner.commit_all()
        batch.target_forwards += 1
        for i, (s, logits) in enumerate(zip(streams, out.logits)):
            if out.hidden is not None:
                s.unseen_hidden.append(out.hidden[i])
            s.stats.prompt_tokens = len(s.prompt)
            self._emit(s, [self._sample_one(logits[0], config.sampling, generator)], config)

    def _step(self, active: list[_Stream], config: DecodeConfig, generator, batch: DecodeStats) -> None:
        drafts = self._propose(active, config, generator, batch)
        t = time.perf_counter()
        trees = [StreamTree(s.sid, d.tree(root=s.generated[-1])) for s, d in zip(active, drafts)]
        # the root is the pending token: already emitted, not yet run through the target
        out = self.runner.forward(trees, hidden_layer=self._hidden_layer(config))
        batch.target_forwards += 1
        accepted: dict[int, list[int]] = {}
        for i, (s, d, st, logits) in enumerate(zip(active, drafts, trees, out.logits)):
            path, next_token = self._verify(d, st.tree, logits, config.sampling, generator)
            s.stats.record_step(d.tokens.numel(), len(path) - 1, int(st.tree.depths.max()))
            s.stats.record_ranks(_accepted_ranks(st.tree, path))
            if d.confidence is not None:
                on_path = set(path)
                tested = [i for i in range(1, len(st.tree)) if int(st.tree.parents[i]) in on_path]
                s.stats.record_calibration([float(d.confidence[i - 1]) for i in tested], [i in on_path for i in tested])
            kept = self._emit(s, st.tree.tokens[path[1:]].tolist() + [next_token], config)
            # KV for the pending token and the accepted drafts that were kept (cache trimmed at a stop)
            accepted[s.sid] = path[: 1 + min(kept, len(path) - 1)]
            if out.hidden is not None:
                s.unseen_hidden.append(out.hidden[i][accepted[s.sid]])
        self.runner.commit(accepted)
        batch.time_verify += time.perf_counter() - t

    def _propose(self, active: list[_Stream], config: DecodeConfig, generator, batch: DecodeStats) -> list[Draft]:
        if config.method == "ar":
            return [Draft.empty() for _ in active]
        t = time.perf_counter()
        requests = [
            # never draft past max_new_tokens: the last token of the budget is always a target token
            DraftRequest(
                s.key,
                s.tokens,
                min(config.num_draft_tokens, config.max_new_tokens - len(s.generated) - 1),
                torch.cat(s.unseen_hidden) if s.unseen_hidden else None,
            )
            for s in active
        ]
        for s in active:
            s.unseen_hidden = []
        before = self.proposer.forwards
        drafts = self.proposer.propose(requests, config.sampling, generator)
        batch.draft_forwards += self.proposer.forwards - before
        batch.time_draft += time.perf_counter() - t
        return drafts

    def _hidden_layer(self, config: DecodeConfig) -> int | None:
        return self.hidden_layer if config.method == "sd" else None

    @staticmethod
    def _verify(
        draft: Draft, tree: TokenTree, logits: torch.Tensor, sampling: SamplingParams, generator
    ) -> tuple[list[int], int]:
        """-> (accepted root-to-node path, recovered or bonus token)."""
        if draft.parents is not None:
            rule = "greedy" if sampling.greedy else draft.rule or "deterministic"
            verdict = verify_tree(tree, target_probs(logits, sampling), draft.node_q(), rule, generator)
            return verdict.path, verdict.next_token
        if sampling.greedy:
            chain = verify_chain_greedy(draft.tokens, logits.argmax(-1))
        else:
            chain = verify_chain(draft.tokens, target_probs(logits, sampling), draft.q, generator)
        return list(range(chain.num_accepted + 1)), chain.next_token

    @staticmethod
    def _sample_one(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return int(sample(target_probs(logits, sampling), generator))

    def _emit(self, s: _Stream, new: list[int], config: DecodeConfig) -> int:
        """Append tokens until a stop condition; returns how many were kept."""
        for i, token in enumerate(new):
            s.generated.append(token)
            s.stats.new_tokens += 1
            if token in self.eos:
                s.finish = "eos"
            elif config.stop and self._hit_stop(s, config.stop):
                s.finish = "stop"
            elif len(s.generated) >= config.max_new_tokens:
                s.finish = "length"
            if s.finish is not None:
                return i + 1
        return len(new)

    def _hit_stop(self, s: _Stream, stop: tuple[str, ...]) -> bool:
        tail = self.detokenize(s.generated[-32:])  # a stop string ends in the newest token
        return any(x in tail for x in stop)

    def _result(self, s: _Stream, batch: DecodeStats) -> StreamResult:
        stats = s.stats
        stats.target_forwards = batch.target_forwards
        stats.draft_forwards = batch.draft_forwards
        stats.time_draft, stats.time_verify, stats.time_total = batch.time_draft, batch.time_verify, batch.time_total
        return StreamResult(s.prompt, s.generated, s.finish or "length", stats)


def _accepted_ranks(tree: TokenTree, path: list[int]) -> list[int]:
    """At each node of the accepted path that has children: the rank of the accepted child among
    them (children are in draft-rank order), or -1 where all were rejected."""
    ranks = []
    for i, node in enumerate(path):
        kids = tree.children(node)
        if kids:
            ranks.append(kids.index(path[i + 1]) if i + 1 < len(path) else -1)
    return ranks
