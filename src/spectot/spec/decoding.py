"""The decoding loop: ``ar`` (the baseline) and ``sd`` (chain speculative decoding) for a batch of
streams, every step one target forward over all of them.

Each stream holds its committed tokens in the target's KV cache plus one *pending* token (sampled,
not yet run). A step is: propose drafts (sd) -> one batched forward over each stream's chain
[pending, x_1..x_k] -> verify -> commit the accepted path -> emit accepted + recovered/bonus tokens,
cut at EOS, stop strings or max_new_tokens. A draft may be a token tree (``Draft.parents``): the
forward then covers the tree and verification follows the accepted root-to-leaf path.

A session's streams may differ in their ``DecodeConfig`` (sampling, budget, stops) and may join
(``add``) and leave (``release``) while others run: the continuous engine behind the local backend
and ``spectot serve`` keeps one session open and batches whatever requests are live.
"""

from __future__ import annotations

import hashlib
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from spectot.engine.prefix_cache import Fork, PrefixCache
from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.spec.draft_length import DraftLength, fan_chain_outcome
from spectot.spec.proposers.base import Draft, DraftRequest, Proposer, drafts_chains
from spectot.spec.sampling import CoupledNoise, SamplingParams, argmax, logsumexp_rows, sample_at, target_probs
from spectot.spec.stats import DecodeStats
from spectot.spec.tree_verify import verify_tree, verify_tree_coupled
from spectot.spec.trees.dynamic import StaticPolicy, TreePolicy
from spectot.spec.trees.shapes import fan_chain_tree
from spectot.spec.verify import verify_chain, verify_chain_coupled

Method = Literal["ar", "sd"]
FinishReason = Literal["eos", "stop", "length"]
CONTEXT_TOKENS = 5  # tokens a completion's text is decoded after (``decode_after``; vLLM's offset too)
MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth a separate forward


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    method: Method = "ar"
    num_draft_tokens: int = 5  # k: draft tokens per verification (sd)
    stop: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in get_args(Method):  # 'mcsd' or 'SD' ran as plain ar
            raise ValueError(f"method must be one of {get_args(Method)}, got {self.method!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        check_stop(self.stop)


def check_stop(stop: object) -> None:
    """Stop strings are a sequence of non-empty strings: a bare string would stop at each of its characters, an
    empty one before the first token."""
    if isinstance(stop, str):
        raise ValueError(f"stop must be a sequence of strings, got the string {stop!r}: pass ({stop!r},)")
    if any(not isinstance(s, str) or not s for s in stop):  # type: ignore[attr-defined]
        raise ValueError(f"stop strings must be non-empty strings, got {tuple(stop)!r}")  # type: ignore[arg-type]


class PromptRefused(ValueError):
    """A prompt the decoder cannot run (``Decoder.prompt_fault``: no tokens, ids outside the vocabulary, past the
    context): its request's own fault, raised again however often it is sent, while other requests go on."""


@dataclass
class StreamResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens (an EOS that ended the stream included)
    finish_reason: FinishReason
    stats: DecodeStats
    logprobs: list[float] = field(default_factory=list)  # log p_target(token) at temperature 1, one per token


@dataclass
class _Stream:
    key: int
    sid: int | None  # the stream's KV in the target cache; None until its prompt is prefilled
    prompt: list[int]
    seed: int  # the stream's token j is drawn with noise E_j(seed, j) (``sample_at``): every engine emits the same
    generator: torch.Generator  # from the seed: a sampling draft's own randomness (and its verification's)
    config: DecodeConfig
    noise: CoupledNoise  # E_j by position: a deterministic draft's guesses read it where the target's draws do
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    finish: FinishReason | None = None
    unseen_hidden: list[torch.Tensor] = field(default_factory=list)  # target hidden states not yet given to the draft
    hidden: list[torch.Tensor] = field(default_factory=list)  # all of them, for the prefix cache (EDD drafts)
    to_fill: int = 0  # prompt tokens still to run when prefilled in chunks (``begin``); its own prompt KV then
    chunked: bool = False
    fan: int = 0  # the adaptive length's draft this step: candidates for its first token (0: not one of those)
    joined: tuple[int, int, float, float, float] = (0, 0, 0.0, 0.0, 0.0)  # the session's counters when it was added

    @property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.prompt + self.generated, dtype=torch.int64)


@dataclass
class _PromptEntry:
    """A prefilled prompt kept in the cache so every stream with that prompt forks its KV."""

    sid: int
    logits: torch.Tensor  # (V,) at the prompt's last token
    hidden: torch.Tensor | None  # (len(prompt), H) for EDD drafts
    users: int = 0  # streams forked from it and not yet released


def stream_seeds(seed: int, *labels: object, n: int, first: int = 0) -> list[int]:
    """Seeds ``first .. first + n - 1`` of the streams a run seeded ``seed`` labels ``labels``: a pure function of
    them, so every engine (and every batching of a job) draws each stream's samples from the same source."""
    digest = hashlib.blake2b(repr((seed, *labels)).encode(), digest_size=8).digest()
    base = int.from_bytes(digest, "little") >> 2
    return [(base + first + i) % 2**62 for i in range(n)]


def prompt_seeds(seed: int, first: int, n: int) -> list[int]:
    """The seeds of prompts ``first .. first + n - 1`` of a job seeded ``seed``: a pure function of the prompt's
    index, so a prompt draws the same samples whatever the batch size, offset or resume point, and no two prompts
    share their noise (each call's default seeds restart from ``config.seed``)."""
    return stream_seeds(seed, "prompt", n=n, first=first)


class Decoder:
    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: Sequence[int] = (),
        proposer: Proposer | None = None,
        detokenize: Callable[[list[int]], str] | None = None,  # needed for stop strings
        prefix_cache_tokens: int = 16384,  # KV of finished sequences kept for later prompts (0: none)
        prefix_cache: PrefixCache | None = None,  # share another decoder's (same runner) instead
        draft_length: DraftLength | None = None,  # adapt a chain draft's k to the acceptance so far (None: k fixed)
    ) -> None:
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        if prefix_cache is not None and prefix_cache.streams is not runner:
            raise ValueError("a shared prefix cache must hold streams of this decoder's runner")
        # it outlives sessions: a search's next level, its evaluations and its next problem find the
        # KV of what ran before (a shared few-shot header, the parent's prompt + step)
        if prefix_cache is None:
            prefix_cache = PrefixCache(runner, prefix_cache_tokens, MIN_SHARED_PREFIX)
        self.prefix_cache = prefix_cache
        self.runner = runner
        self.eos = frozenset(eos_token_ids)
        self.proposer = proposer
        self.detokenize = detokenize
        self.draft_length = draft_length

    @property
    def hidden_layer(self) -> int | None:
        """The target layer whose hidden states of verified tokens the draft reads (EDD), if any."""
        return getattr(self.proposer, "hidden_layer", None)

    def clear_prefix_caches(self) -> None:
        """Start cold: drop the target's kept prefixes and the draft's own (a trained draft keeps its KV too), so
        the next prompt is prefilled whole, as a timed comparison needs."""
        self.prefix_cache.clear()
        draft_cache = getattr(self.proposer, "prefixes", None)
        if draft_cache is not None:
            draft_cache.clear()

    def generate(
        self, prompts: Sequence[Sequence[int]], config: DecodeConfig, seeds: Sequence[int] | None = None
    ) -> list[StreamResult]:
        """All streams together: every step one target forward over all unfinished streams.
        ``seeds``: one per prompt (default: drawn from ``config.seed``); a stream's samples depend only on its seed,
        with no draft or a deterministic one (n-gram, top-token children); a draft that samples (a draft model,
        sampled children) draws on the stream's generator as many times as its k asks, which a draft length may
        pick by the batch: there the seed fixes the distribution, not the tokens."""
        with self.session(prompts, config, seeds) as session:
            session.prefill(session.streams)
            active = [s for s in session.streams if s.finish is None]
            while active:
                session.verify(active, session.propose(active))
                active = [s for s in active if s.finish is None]
        return session.results()

    def prompt_fault(self, prompt: Sequence[int], config: DecodeConfig) -> str | None:
        """Why ``prompt`` cannot be decoded under ``config`` ("has 9000 tokens; ..."), or None when it can."""
        if not prompt:
            return "has no tokens"
        vocab = self.runner.model.get_input_embeddings().num_embeddings
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab:  # it would fail the forward it shares with other requests
            return f"has token id {low if low < 0 else high}, outside the model's vocabulary of {vocab} ids"
        if len(prompt) + config.max_new_tokens > self.runner.max_context:
            return (
                f"has {len(prompt)} tokens; with max_new_tokens={config.max_new_tokens} it exceeds the model's "
                f"context of {self.runner.max_context} tokens"
            )
        return None

    def session(
        self, prompts: Sequence[Sequence[int]], config: DecodeConfig, seeds: Sequence[int] | None = None
    ) -> DecodeSession:
        return DecodeSession(self, prompts, config, seeds)


class DecodeSession:
    """The streams of one call. A scheduler drives the phases — ``prefill``, ``propose``,
    ``verify`` — over any subset of unfinished streams, in any order, as long as a stream is in
    one phase at a time (SEED drafts some streams while the target verifies others)."""

    def __init__(
        self, decoder: Decoder, prompts: Sequence[Sequence[int]], config: DecodeConfig, seeds: Sequence[int] | None
    ) -> None:  # ``add`` checks the prompts and config (at the end, before any stream exists)
        self.decoder, self.runner, self.proposer, self.config = decoder, decoder.runner, decoder.proposer, config
        self.batch = DecodeStats()
        self._t0 = time.perf_counter()
        self._closed = False
        self._prompts: dict[tuple[int, ...], _PromptEntry] = {}
        # an EDD draft reads the target's hidden states of every token: its entries carry them
        self.prefix_cache = decoder.prefix_cache
        self.prefilled_tokens = 0  # prompt tokens run through the target (not shared, not cached)
        self.cached_tokens = 0  # prompt tokens whose KV was already there (the prefix cache, a shared header)
        self.streams: list[_Stream] = []  # live and finished streams, released ones excluded
        self._next_key = 0
        self.add(prompts, config, seeds)

    def add(
        self, prompts: Sequence[Sequence[int]], config: DecodeConfig, seeds: Sequence[int] | None = None
    ) -> list[_Stream]:
        """New streams (not yet prefilled) that decode under ``config``; ``seeds`` default to draws
        from ``config.seed``."""
        if config.method == "sd" and self.proposer is None:
            raise ValueError("method 'sd' needs a draft: pass a proposer (a draft model or ngram)")
        if config.stop and self.decoder.detokenize is None:
            raise ValueError("stop strings need a detokenizer")
        if any(len(p) == 0 for p in prompts):
            raise PromptRefused("every prompt needs at least one token")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if (fault := self.decoder.prompt_fault(p, config)) is not None:
                raise PromptRefused(f"prompt {i} {fault}")
        if seeds is None:  # independent per-stream seeds drawn from the call's seed
            seeds = torch.randint(2**62, (len(prompts),), generator=torch.Generator().manual_seed(config.seed)).tolist()
        first, self._next_key = self._next_key, self._next_key + len(prompts)
        b = self.batch
        joined = (b.target_forwards, b.draft_forwards, b.time_draft, b.time_verify, time.perf_counter())
        new = [
            _Stream(first + i, None, list(p), seed, torch.Generator().manual_seed(seed), config, CoupledNoise(seed))
            for i, (p, seed) in enumerate(zip(prompts, seeds))
        ]
        for s in new:
            s.joined = joined
        self.streams += new
        return new

    def release(self, s: _Stream) -> None:
        """Free a stream's KV and draft state (finished or abandoned); its prompt's KV goes with
        its last user. The KV moves to the prefix cache, which frees it when it needs the room."""
        self._free(s, keep=True)
        s.finish = s.finish or "length"
        self.streams.remove(s)

    def _free(self, s: _Stream, keep: bool) -> None:
        if s.sid is not None:
            if keep:
                held = (s.prompt + s.generated)[: self.runner.length(s.sid)]  # tokens whose KV it has
                layer = self._hidden_layer()
                hidden = torch.cat(s.hidden)[: len(held)] if layer is not None and s.hidden else None
                self.prefix_cache.keep(s.sid, held, hidden, layer)
            else:
                self.runner.release(s.sid)
            s.sid = None
            entry = None if s.chunked else self._prompts.get(tuple(s.prompt))
            if entry is not None:
                entry.users -= 1
                if entry.users == 0:
                    self._free_prompt(tuple(s.prompt), keep)
        if self.proposer is not None:
            self.proposer.release(s.key, keep)

    def _free_prompt(self, prompt: tuple[int, ...], keep: bool) -> None:
        entry = self._prompts.pop(prompt)
        if keep:
            self.prefix_cache.keep(entry.sid, prompt, entry.hidden, self._hidden_layer())
        else:
            self.runner.release(entry.sid)

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(keep=exc_type is None)

    def close(self, keep: bool = True) -> None:
        """Free every stream (their results stay readable); ``keep``: their KV and their prompts' goes
        to the prefix cache for later calls, else it is released (after an error mid-step). Once: a later call (the
        ``with`` block's exit after an explicit close) does nothing."""
        if self._closed:
            return
        self._closed = True
        self.runner.abort()  # an error mid-step must not leave a forward pending
        for s in self.streams:
            self._free(s, keep)
        for prompt in list(self._prompts):  # prompts whose streams are all gone
            self._free_prompt(prompt, keep)
        self.batch.time_total = time.perf_counter() - self._t0

    def results(self) -> list[StreamResult]:
        return [self.result(s) for s in self.streams]

    # -- phases ----------------------------------------------------------------------------
    def prefill(self, streams: Sequence[_Stream]) -> None:
        """Run each stream's prompt; its first new token becomes pending. Prompts are prefilled once
        per distinct text (the n thoughts of one state fork one prompt's KV) and a prefix common to
        all new prompts (a shared few-shot header) is run once."""
        new = list(dict.fromkeys(tuple(s.prompt) for s in streams if tuple(s.prompt) not in self._prompts))
        if new:
            self._prefill_prompts(new)
        hidden_layer = self._hidden_layer()
        for s in streams:
            entry = self._prompts[tuple(s.prompt)]
            s.sid = self.runner.new_stream(fork_of=entry.sid)
            entry.users += 1
            if hidden_layer is not None:
                s.unseen_hidden.append(entry.hidden)
                s.hidden.append(entry.hidden)
            s.stats.prompt_tokens = len(s.prompt)
            token = self._sample_one(entry.logits, s)
            self._emit(s, [token], _logprobs(entry.logits[None], [token]))

    def begin(self, streams: Sequence[_Stream]) -> None:
        """Prefill ``streams`` in chunks instead: each forks its longest cached prefix now and runs the
        rest a few tokens at a time inside later forwards (``verify(..., filling=)``), so a long prompt
        never stalls the streams already decoding (SPEX: speculative work must not delay primary work).
        Under an EDD draft each chunk's hidden states join the stream's as they arrive."""
        layer = self._hidden_layer()
        for s in streams:
            s.sid, cached, hidden = self.prefix_cache.fork(s.prompt[:-1], layer)
            s.to_fill, s.chunked = len(s.prompt) - cached, True
            self.cached_tokens += cached
            if hidden is not None:
                s.unseen_hidden.append(hidden)
                s.hidden.append(hidden)

    def _prefill_prompts(self, prompts: list[tuple[int, ...]]) -> None:
        """One forward over the new prompts, each forked from its longest cached prefix (at least its
        last token runs, for the logits). A prefix all of them share beyond what the cache holds (a
        few-shot header) runs once first. Under an EDD draft the cache hands back the hidden states
        of what it reuses, and keeps them with what it keeps."""
        layer = self._hidden_layer()
        shared = _common_prefix_len(prompts) if len(prompts) > 1 else 0
        base = None
        if shared - self.prefix_cache.longest(prompts[0][:shared], layer)[1] >= MIN_SHARED_PREFIX:
            base = self.prefix_cache.fork(prompts[0][:shared], layer)
            try:
                out = self.runner.forward(
                    [StreamTree(base.sid, TokenTree.chain(prompts[0][base.length : shared]))],
                    last_only=True,
                    hidden_layer=layer,
                )
                self.runner.commit_all()
            except BaseException:  # the shared prefix is nobody's yet: release it, or its slots leak
                self.runner.release(base.sid)
                raise
            self.batch.target_forwards += 1
            self.prefilled_tokens += shared - base.length
            self.cached_tokens += base.length
            base = Fork(base.sid, shared, None if layer is None else _join(base.hidden, out.hidden[0]))
            if self.prefix_cache.max_tokens:  # the prompts find it in the cache, with anything longer
                self.prefix_cache.keep(base.sid, prompts[0][:shared], base.hidden, layer)
                base = None
        forks: list[Fork] = []
        try:
            for p in prompts:
                if base is None:
                    forks.append(self.prefix_cache.fork(p[:-1], layer))
                else:
                    forks.append(base._replace(sid=self.runner.new_stream(fork_of=base.sid)))
            trees = [StreamTree(f.sid, TokenTree.chain(list(p[f.length :]))) for f, p in zip(forks, prompts)]
            out = self.runner.forward(trees, last_only=True, hidden_layer=layer)
        except BaseException:  # the forks (and the shared prefix) are nobody's yet: release them, or they leak
            for sid in [f.sid for f in forks] + ([base.sid] if base is not None else []):
                self.runner.release(sid)
            raise
        self.runner.commit_all()
        self.batch.target_forwards += 1
        self.prefilled_tokens += sum(len(st.tree) for st in trees)
        self.cached_tokens += sum(f.length for f in forks)
        for i, (p, f) in enumerate(zip(prompts, forks)):
            hidden = None if layer is None else _join(f.hidden, out.hidden[i])
            self._prompts[p] = _PromptEntry(f.sid, out.logits[i][0], hidden)
            if self.prefix_cache.max_tokens:  # later prompts of this call find it too (a serial engine's next one)
                self.prefix_cache.keep(self.runner.new_stream(fork_of=f.sid), p, hidden, layer)
        if base is not None:
            self.runner.release(base.sid)

    def propose(
        self, streams: Sequence[_Stream], policy: TreePolicy | None = None, drafted: Sequence[bool] | None = None
    ) -> list[Draft]:
        """Drafts for ``streams`` (empty ones under ``ar``, and where ``drafted`` says False: such a step is an
        ``ar`` step, the same token); ``policy`` overrides the proposer's tree.
        Streams that sample alike are drafted in one proposer call. With the decoder's ``draft_length``
        (a chain proposer, no policy) their k is k* for their acceptance so far; k* = 0 skips their draft;
        w* > 1 (a draft decoder) adds the first token's runners-up (``shapes.fan_chain_tree``).
        A free draft that reports its evidence (``Draft.match``) is looked up in full, then each stream's
        is cut to the k* of its class."""
        drafts: list[Draft] = [Draft.empty()] * len(streams)
        groups: dict[SamplingParams, list[int]] = {}
        for i, s in enumerate(streams):
            if s.config.method == "sd" and (drafted is None or drafted[i]):
                groups.setdefault(s.config.sampling, []).append(i)
        if not groups:
            return drafts
        adapt = self.decoder.draft_length if policy is None and drafts_chains(self.proposer) else None
        look_first = adapt is not None and getattr(self.proposer, "reports_match", False)
        context = self._context(streams) if adapt is not None and not look_first else 0
        extra_rows = 0  # rows the groups drafted so far add to the forward
        for sampling, members in groups.items():
            t, before = time.perf_counter(), self.proposer.forwards
            k, tree, width = None, policy, 0
            if adapt is not None and not look_first:
                room = max(_draft_room(streams[i]) for i in members)
                k, width = adapt.choose_tree(sampling, room, len(streams), context, len(members), extra_rows)
                if k == 0:
                    continue
                if width > 1:
                    tree = _fan_chain_policy(width, k)
            requests = [self._draft_request(streams[i], tree, k, len(streams)) for i in members]
            for i, d in zip(members, self.proposer.propose(requests, sampling, None)):
                if look_first and d.tokens.numel():
                    d = d.cut(adapt.choose(sampling, d.tokens.numel(), len(streams), d.match, len(members)))
                drafts[i], streams[i].fan = d, width
                extra_rows += d.tokens.numel()
            seconds, forwards = time.perf_counter() - t, self.proposer.forwards - before
            self.batch.draft_forwards += forwards
            self.batch.time_draft += seconds
            if self.decoder.draft_length is not None:  # d(m): this group's own draft forwards
                self.decoder.draft_length.observe_draft(seconds, forwards, len(members))
        return drafts

    def _draft_request(
        self, s: _Stream, policy: TreePolicy | None, k: int | None = None, streams: int = 0
    ) -> DraftRequest:
        hidden = torch.cat(s.unseen_hidden) if s.unseen_hidden else None
        s.unseen_hidden = []
        k = _draft_room(s) if k is None else min(k, _draft_room(s))
        noise = None if s.config.sampling.greedy else s.noise
        return DraftRequest(
            s.key,
            s.tokens,
            k,
            hidden,
            generator=s.generator,
            policy=policy,
            noise=noise,
            position=len(s.generated),
            streams=streams,
        )

    def verify(
        self, streams: Sequence[_Stream], drafts: Sequence[Draft], filling: Sequence[tuple[_Stream, int]] = ()
    ) -> None:
        """One target forward over every stream's tree (root = its pending token), then verify,
        commit the accepted paths and emit. ``filling``: (stream prefilled in chunks (``begin``), how
        many of its next prompt tokens ride along); a stream whose prompt completes samples
        its first token, as ``prefill`` does."""
        t = time.perf_counter()
        trees = [StreamTree(s.sid, d.tree(root=s.generated[-1])) for s, d in zip(streams, drafts)]
        # the root is the pending token: already emitted, not yet run through the target
        chunks = [(s, s.prompt[len(s.prompt) - s.to_fill :][:n]) for s, n in filling if n > 0]
        trees += [StreamTree(s.sid, TokenTree.chain(tokens)) for s, tokens in chunks]
        rows = None
        if chunks:  # a chunk needs logits only where it completes its prompt
            rows = [range(len(st.tree)) for st in trees[: len(streams)]]
            rows += [[len(tokens) - 1] if len(tokens) == s.to_fill else [] for s, tokens in chunks]
        length = self.decoder.draft_length
        context = [self.runner.length(st.stream) for st in trees] if length is not None else []  # forward time
        out = self.runner.forward(trees, logit_rows=rows, hidden_layer=self._hidden_layer())
        self.batch.target_forwards += 1
        accepted: dict[int, list[int]] = {}
        for i, (s, d, st, logits) in enumerate(zip(streams, drafts, trees, out.logits)):
            path, next_token = self._verify(d, st.tree, logits, s)
            parents = st.tree.parents.tolist()
            # the whole verified path is evidence of the draft's agreement, past a stop that ends the stream too (the
            # target did verify those drafts): ranks, calibration and the draft length's acceptance read it all
            s.stats.record_ranks(_accepted_ranks(parents, path))
            if length is not None:
                self._observe_length(s, d, path)
            if d.confidence is not None:
                conf = d.confidence.tolist()  # NaN: no draft confidence (a grafted prompt-lookup branch)
                tested = [v for v in _tested(parents, path, d.rule is not None) if not math.isnan(conf[v - 1])]
                s.stats.record_calibration([conf[v - 1] for v in tested], [v in path for v in tested])
            new = st.tree.tokens[path[1:]].tolist() + [next_token]
            kept = self._emit(s, new, _logprobs(logits, new, path))
            # a stop inside the accepted path ends the stream there: the step counts as a draft cut at the stop
            # (its last kept token plays the bonus token), so accepted + steps is what the stream emitted
            reached = _depth_reached(parents, path) if kept == len(new) else kept - 1
            s.stats.record_step(d.tokens.numel(), kept - 1, reached)
            # KV for the pending token and the accepted drafts that were kept (cache trimmed at a stop)
            accepted[s.sid] = path[: 1 + min(kept, len(path) - 1)]
            if out.hidden is not None:
                s.unseen_hidden.append(out.hidden[i][accepted[s.sid]])
                s.hidden.append(s.unseen_hidden[-1])
        for s, tokens in chunks:
            accepted[s.sid] = list(range(len(tokens)))
        self.runner.commit(accepted)
        if length is not None:
            work = sum(len(st.tree) * c for st, c in zip(trees, context))
            length.observe_verify(time.perf_counter() - t, sum(len(st.tree) for st in trees), sum(context), work)
        for i, ((s, tokens), logits) in enumerate(zip(chunks, out.logits[len(streams) :]), start=len(streams)):
            if out.hidden is not None:
                s.unseen_hidden.append(out.hidden[i])
                s.hidden.append(out.hidden[i])
            s.to_fill -= len(tokens)
            self.prefilled_tokens += len(tokens)
            if s.to_fill == 0:
                s.stats.prompt_tokens = len(s.prompt)
                token = self._sample_one(logits[0], s)
                self._emit(s, [token], _logprobs(logits, [token]))
        self.batch.time_verify += time.perf_counter() - t

    def _context(self, streams: Sequence[_Stream]) -> int:
        """Context tokens the streams' next forward reads."""
        return sum(self.runner.length(s.sid) for s in streams if s.sid is not None)

    def _observe_length(self, s: _Stream, d: Draft, path: list[int]) -> None:
        """Tell the adaptive length what its draft of this stream achieved."""
        length, fan = self.decoder.draft_length, s.fan
        s.fan = 0
        if fan and d.tokens.numel():  # its own chain or fan (a lookup branch grafted beside it is not its evidence)
            parents = None if d.parents is None else d.parents.tolist()
            proposed, accepted, rank = fan_chain_outcome(parents, d.tokens.numel(), fan, path)
            length.observe(s.config.sampling, proposed, accepted, width=fan, rank=rank)
        elif d.parents is None:  # a free draft cut to its class's k, or a fixed-length chain
            length.observe(s.config.sampling, d.tokens.numel(), len(path) - 1, d.match)

    def _hidden_layer(self) -> int | None:
        # every forward, whatever the session's first config: streams that join later may draft (EDD)
        return self.decoder.hidden_layer

    def _verify(self, draft: Draft, tree: TokenTree, logits: torch.Tensor, s: _Stream) -> tuple[list[int], int]:
        """-> (accepted root-to-node path, recovered or bonus token). Deterministic drafts (greedy streams, or a
        one-hot q) follow the target's own token at each row: its argmax, or the draw plain decoding makes at
        that position (``sample_at``), so the output equals ``ar``'s token for token. A sampling draft under a
        sampling stream keeps speculative sampling."""
        sampling, first = s.config.sampling, len(s.generated)  # the root's token is generated token ``first``
        if sampling.greedy:
            best = argmax(logits).tolist()

            def target(row: int, depth: int) -> int:
                return best[row]
        else:

            def target(row: int, depth: int) -> int:  # only the rows on the accepted path are drawn
                position = first + depth
                return sample_at(target_probs(logits[row], sampling), s.seed, position)

        if draft.parents is not None:
            if sampling.greedy or draft.rule in (None, "deterministic"):
                depths = tree.depths.tolist()
                verdict = verify_tree_coupled(tree, lambda u: target(u, depths[u]))
            else:
                verdict = verify_tree(tree, target_probs(logits, sampling), draft.node_q(), draft.rule, s.generator)
            return verdict.path, verdict.next_token
        if sampling.greedy or draft.q is None:
            chain = verify_chain_coupled(draft.tokens, lambda i: target(i, i))
        else:
            chain = verify_chain(draft.tokens, target_probs(logits, sampling), draft.q, s.generator)
        return list(range(chain.num_accepted + 1)), chain.next_token

    def _sample_one(self, logits: torch.Tensor, s: _Stream) -> int:
        """The stream's next token on its own: plain decoding's draw at its position."""
        if s.config.sampling.greedy:
            return int(argmax(logits))
        position = len(s.generated)
        return sample_at(target_probs(logits, s.config.sampling), s.seed, position)

    def _emit(self, s: _Stream, new: list[int], logprobs: list[float]) -> int:
        """Append tokens until a stop condition; returns how many were kept."""
        config = s.config
        for i, (token, logprob) in enumerate(zip(new, logprobs)):
            s.generated.append(token)
            s.logprobs.append(logprob)
            s.stats.new_tokens += 1
            if token in self.decoder.eos:
                s.finish = "eos"
            elif config.stop and hit_stop(s.generated, config.stop, self.decoder.detokenize, s.prompt):
                s.finish = "stop"
            elif len(s.generated) >= config.max_new_tokens:
                s.finish = "length"
            if s.finish is not None:
                return i + 1
        return len(new)

    def result(self, s: _Stream) -> StreamResult:
        """The stream's output; its forwards and times are the session's while the stream was in it (a batched
        call's streams: the whole batch's; a stream that joined a running session: from then until now or the
        session's close)."""
        stats, batch = s.stats, self.batch
        forwards, draft_forwards, time_draft, time_verify, joined_at = s.joined
        stats.target_forwards = batch.target_forwards - forwards
        stats.draft_forwards = batch.draft_forwards - draft_forwards
        stats.time_draft, stats.time_verify = batch.time_draft - time_draft, batch.time_verify - time_verify
        end = self._t0 + batch.time_total if batch.time_total else time.perf_counter()
        stats.time_total = max(end - joined_at, 0.0)
        return StreamResult(s.prompt, s.generated, s.finish or "length", stats, s.logprobs)


@functools.cache
def _fan_chain_policy(width: int, k: int) -> StaticPolicy:
    return StaticPolicy(tuple(fan_chain_tree(width, k)))


def _draft_room(s: _Stream) -> int:
    """k, capped so a draft never runs past max_new_tokens: the budget's last token is a target token."""
    return min(s.config.num_draft_tokens, s.config.max_new_tokens - len(s.generated) - 1)


def hit_stop(
    tokens: Sequence[int], stop: Sequence[str], detokenize: Callable[[list[int]], str], context: Sequence[int] = ()
) -> bool:
    """Whether the newest of ``tokens`` (the generated ones, after ``context``: the prompt's) completes a stop
    string. Only the tail is decoded: a stop string of L characters ends in the newest token and spans at most L
    tokens that show text, and a character may take up to 4 byte tokens, so 32 + 4 L tokens suffice (a fixed 32
    missed stop strings of more than 32 words); while they include the first generated token they are decoded
    after the prompt (``decode_after``), so a stop string that opens with a space matches on the first token of a
    SentencePiece tokenizer's text."""
    window = 32 + 4 * max((len(x) for x in stop), default=0)
    if len(tokens) > window:  # no stop string reaches the window's first token, where a start-of-text rule acts
        tail = detokenize(list(tokens[-window:]))
    else:
        tail = decode_after(detokenize, context, tokens)
    return any(x in tail for x in stop)


def decode_after(detokenize: Callable[[list[int]], str], context: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after the last CONTEXT_TOKENS of ``context``: decode(context + ids) minus
    decode(context) (vLLM's way). Decoded alone, a completion meets the tokenizer's start-of-text rules: a
    SentencePiece (Metaspace) tokenizer drops its leading space. Example, Llama-2's tokenizer: [▁Paris, .] reads
    "Paris.", after the prompt's [▁capital, ▁is] " Paris."."""
    head = list(context[-CONTEXT_TOKENS:])
    if not head:
        return detokenize(list(ids))
    return detokenize(head + list(ids))[len(detokenize(head)) :]


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string (the stop string itself is not part of the output)."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def _logprobs(logits: torch.Tensor, tokens: Sequence[int], rows: Sequence[int] | None = None) -> list[float]:
    """log p(token_i) = z_r[token_i] - log sum_j exp(z_r[j]) under the raw target distribution at row r = rows[i]
    (default i) of ``logits`` (R, V): only those rows are normalised, and a row gives the same value whichever
    path asks (AR, a verified tree, a prefill)."""
    rows = list(range(len(tokens))) if rows is None else list(rows)
    picked = logits[rows, list(tokens)].tolist()
    return [z - norm for z, norm in zip(picked, logsumexp_rows(logits, rows))]


def _join(prefix: torch.Tensor | None, rest: torch.Tensor) -> torch.Tensor:
    return rest if prefix is None else torch.cat([prefix, rest])


def _common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens all prompts share at their start, leaving at least one token of each to run."""
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        i = 0
        while i < n and p[i] == first[i]:
            i += 1
        n = i
    return n


def _depth_reached(parents: list[int], path: list[int]) -> int:
    """The deepest draft position verification tested: the accepted path's, one more where its last node has
    children (all rejected). A shallow leaf accepted reaches no deeper, however deep other branches go.
    Example: parents [-1, 0, 0, 1] (a fan: 1 -> 3 and 2), path [0, 2]: 1; path [0, 1]: 2."""
    return len(path) - 1 + (path[-1] in parents)


def _tested(parents: list[int], path: list[int], in_order: bool) -> list[int]:
    """The nodes verification tested: the children of the accepted path's nodes; with ``in_order`` (sampled
    siblings, tried one after another) only those up to the accepted one. Example: parents [-1, 0, 0, 1, 1],
    path [0, 1]: [1, 2, 3, 4]; in order, [1, 3, 4] (node 2 came after the accepted node 1)."""
    on_path, accepted = set(path), dict(zip(path, path[1:]))  # a path node -> its accepted child
    return [
        v
        for v in range(1, len(parents))
        if parents[v] in on_path and not (in_order and v > accepted.get(parents[v], len(parents)))
    ]


def _accepted_ranks(parents: list[int], path: list[int]) -> list[tuple[int, int]]:
    """At each node of the accepted path that has children: (the rank of the accepted child among them
    (children are in draft-rank order), or -1 where all were rejected; how many children it has)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents[1:], start=1):
        children.setdefault(parent, []).append(node)
    ranks = []
    for i, node in enumerate(path):
        kids = children.get(node)
        if kids:
            ranks.append((kids.index(path[i + 1]) if i + 1 < len(path) else -1, len(kids)))
    return ranks
