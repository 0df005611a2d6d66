"""Drafting chains and token trees with a trained draft decoder (EDD or VDM, ``models/draft_decoder.py``).

The draft keeps one KV stream per decoding stream holding its *committed* entries: for EDD the
target's hidden states of every verified token (fed through the draft's hidden projection), for VDM
the verified tokens themselves. Each propose call is:

1. catch up and draft depth 1 in one forward: [new committed entries..., pending token], logits at
   the pending token; the committed entries and the pending token stay in the draft's cache;
2. grow the block (the pending token and the drafted nodes) depth by depth. Where a depth expands one
   node whose parent is the last node kept (a chain, or a tree growing one branch), the forward is that
   node alone over the cache, and it stays there too; otherwise the kept block nodes are dropped and the
   forward runs over the whole block, keeping nothing. One row instead of the block's d made a chain's
   draft forwards ~20 % cheaper on a 2-core Xeon (0.73 ms for one row, 0.96 for six). At the end the
   cache is cut back to the committed entries.

Where the runner has its native layer loop, one stream drafting top tokens skips that loop (``_native``): a
chain is one native call, a tree one call for depth 1 and one a depth after it, each node run once over its
ancestors' entries in a scratch stream (no tree, commit or cut per depth; the policy still decides each depth
here). The same ops on the same inputs, so the same drafts bit for bit, for about a third less propose time
on Zen 3 (``scripts/native_draft_ab.py``).

Which children a frontier node gets is the tree policy's decision (``spec/trees/dynamic.py``: a
static shape such as a chain, k_config or Sequoia's tree, or PCT / VCT / CAPE / EAGLE-2). How the
children are picked decides the verification rule:

- ``top`` (always under greedy decoding): the policy's ranks are the draft's top-K tokens, q is
  one-hot -> rule ``deterministic`` (``greedy`` at temperature 0). Under sampling, rank 0 is instead the
  coupled guess argmax_i q_i / E_{j,i}, E_j the noise the target draws token j with (``sampling.coupled_pick``):
  verification compares each drafted token with that draw, so the guess lands with probability
  P(argmax q/E = argmax p/E) >= (1 - TV) / (1 + TV), where the argmax lands with p(argmax q) -- at T = 1 on
  GSM8K thoughts 0.45 against 0.34 for the shipped EDD's first token (``scripts/coupling_probe.py``).
- ``without_replacement`` (Sequoia): rank r is the r-th distinct draw from q (Gumbel top-k).
- ``with_replacement`` (SpecInfer, MCSD): rank r is the r-th i.i.d. draw from q.
Sampled children keep the draft distribution q they were drawn from for the verifier.

With ``lookup`` = n > 0, a ``top`` draft also gets the prompt-lookup continuation of a trailing n-gram match
(n tokens or more) grafted below its root (``ngram.graft``): the draft guesses what the target will say,
the lookup what it will copy (Creative Writing's given sentences, a question's numbers restated), where a
one-layer draft accepts least. Both are deterministic, so one target forward verifies both losslessly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from typing import Literal, get_args

import torch

from spectot.engine.prefix_cache import PrefixCache
from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.models.draft_decoder import DraftDecoder
from spectot.spec.proposers.base import Draft, DraftRequest
from spectot.spec.proposers.ngram import graft, lookup_match
from spectot.spec.sampling import SamplingParams, coupled_pick, target_probs
from spectot.spec.trees.dynamic import PCTPolicy, StaticPolicy, TreePolicy, refuse_sampled_pruning
from spectot.spec.trees.shapes import chain_tree

ChildSampling = Literal["top", "without_replacement", "with_replacement"]


@dataclass
class _Block:
    """The growing draft tree of one stream; node 0 is the pending token."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    conf: list[float] = field(default_factory=lambda: [1.0])  # path confidence (product of draft probs)
    prob: list[float] = field(default_factory=lambda: [1.0])  # the rank's draft probability the policy reads
    # the node's own draft probability given its parent (``prob`` but for a coupled guess ranked first, which
    # keeps the largest value; NaN where unknown): the confidence calibration reads
    own: list[float] = field(default_factory=lambda: [1.0])
    q: list[torch.Tensor | None] = field(default_factory=lambda: [None])  # distribution each node was drawn from
    frontier: list[int] = field(default_factory=lambda: [0])


class DraftDecoderProposer:
    def __init__(
        self,
        draft: DraftDecoder,
        runner: ModelRunner,
        policy: TreePolicy | None = None,  # None: a chain of the request's k tokens
        children: ChildSampling = "top",
        name: str = "edd",
        prefix_tokens: int = 16384,  # draft KV of released streams kept for later prompts that extend them (0: off)
        lookup: int = 0,  # graft the prompt-lookup continuation of a match of >= this many tokens (0: off)
        lookup_accept: float = 0.5,  # a: a grafted token's chance to be accepted, for PCT's joint selection
        coupled: bool = True,  # sampling streams: rank 0 is the guess argmax q / E_j (else the argmax of q)
    ) -> None:
        if lookup < 0:
            raise ValueError(f"the prompt-lookup match length must be >= 0 (0: off), got {lookup}")
        if children not in get_args(ChildSampling):
            raise ValueError(f"children must be one of {', '.join(get_args(ChildSampling))}, got {children!r}")
        refuse_sampled_pruning(policy, children)
        self.draft = draft
        self.runner = runner
        self.policy = policy
        self.children = children
        self.name = name
        if not 0.0 <= lookup_accept <= 1.0:
            raise ValueError(f"lookup_accept is a probability, got {lookup_accept}")
        self.lookup, self.lookup_accept = lookup, lookup_accept
        self.coupled = coupled
        self.forwards = 0
        self.hidden_layer = draft.config.hidden_layer  # the decoder passes these target hidden states
        self._head_ids = draft.head_ids.cpu()  # the drafting logic runs on the host, on host logits
        self._head_list = self._head_ids.tolist()
        self._fits_head(policy)
        self._embedding = draft.model.get_input_embeddings().weight
        proj = draft.hidden_proj
        self._hidden_proj = None if proj is None else runner.prepare_linear(proj.weight, proj.bias)
        cur, nxt = draft.current_proj, draft.next_proj
        self._current_proj = None if cur is None else runner.prepare_linear(cur.weight, cur.bias)
        self._next_proj = None if nxt is None else runner.prepare_linear(nxt.weight, nxt.bias)
        self._vocab = int(draft.model.config.vocab_size)
        self._streams: dict[int, int] = {}  # decoding key -> draft KV stream
        self._scratch: int | None = None  # a stream holding a native tree's nodes while it grows (``_native_tree``)
        self._committed: dict[int, torch.Tensor] = {}  # decoding key -> the tokens in the draft's cache
        # hidden states a request brought that no catch-up read yet (a step that drafted nothing): the next
        # request's ``hidden`` only holds the rows since it, so they wait here
        self._unread: dict[int, torch.Tensor] = {}
        # a search's prompts extend each other: a new stream forks the draft KV of the longest kept
        # prefix instead of running its whole prompt through the draft (on a 2-core Zen 5, rStar + SPEX +
        # EDD spent 0.5 s of 19 s on those prompt catch-ups)
        self.prefixes = PrefixCache(runner, max_tokens=prefix_tokens)

    def propose(
        self, requests: Sequence[DraftRequest], params: SamplingParams, generator: torch.Generator | None
    ) -> list[Draft]:
        mode: ChildSampling = "top" if params.greedy else self.children
        # the draft's own distribution: under greedy decoding its plain softmax (the target's one-hot
        # greedy "distribution" would make every confidence 1 and every sibling a zero-probability tie)
        draft_params = SamplingParams(do_sample=True, temperature=1.0) if params.greedy else params
        blocks = {r.key: _Block([int(r.tokens[-1])]) for r in requests}
        requests = [self._with_unread(r) for r in requests]
        # PCT prices a tree by the forward it is verified in: every stream's, not only this sampling group's
        policies = {r.key: self._policy_for(r, r.streams or len(requests)) for r in requests}
        for r in requests:  # a tree budget may hand out another policy than the proposer's own (checked at init)
            if r.policy is not None:
                self._fits_head(r.policy)
            if mode != "top":
                refuse_sampled_pruning(policies[r.key], mode)
        # a tree of the root alone (the hardware-aware rule picks n = 1 for a large batch) drafts nothing
        active = [r for r in requests if r.k > 0 and self._room(r) > 0 and policies[r.key].max_depth > 0]
        drafting = {r.key for r in active}
        for r in requests:
            if r.key not in drafting and r.hidden is not None:  # kept for the catch-up of its next draft
                self._unread[r.key] = r.hidden
        for r in active:
            if r.key not in self._streams:
                fork = self.prefixes.fork(r.tokens[:-1].tolist())
                # under W_n a row holds its successor's embedding: the last reused row was made for the cached
                # sequence's next token, which this prompt may not share, so it is made again
                length = fork.length - 1 if self._next_proj is not None and fork.length else fork.length
                self.runner.truncate(fork.sid, length)
                self._streams[r.key], self._committed[r.key] = fork.sid, r.tokens[:length]
            # block nodes a propose that raised left in the draft's cache are scratch: drop them
            self.runner.truncate(self._streams[r.key], self._committed[r.key].numel())
        native = len(active) == 1 and self._native(
            active[0], blocks[active[0].key], policies[active[0].key], mode, draft_params
        )
        if native:
            active = []  # drafted
        kept: dict[int, list[int]] = {r.key: [] for r in active}  # block nodes in the draft cache (a root path)
        depth = 1
        while active:
            expand = {
                r.key: policies[r.key].frontier_to_expand(depth, self._frontier_conf(blocks[r.key])) for r in active
            }
            if depth > 1:
                active = [r for r in active if expand[r.key]]
                if not active:
                    break
            all_logits = self._forward_depth(active, blocks, expand, kept, depth)
            if depth == 1:
                for r in active:
                    self._committed[r.key] = r.tokens[:-1]
            self.forwards += 1
            still = []
            for r, logits in zip(active, all_logits):
                q_sub = target_probs(logits, draft_params)  # (rows, head_vocab)
                read = expand[r.key] if depth > 1 else [0]
                noise = None  # a sampling stream's noise for the children's position, on the head's tokens
                if mode == "top" and self.coupled and r.noise is not None:
                    noise = r.noise.at(r.position + depth - 1, self._head_ids)
                generator_r = r.generator or generator
                grew = self._grow(blocks[r.key], policies[r.key], depth, read, q_sub, mode, generator_r, noise)
                if grew and depth < min(r.k, policies[r.key].max_depth, self._room(r)):
                    still.append(r)
            active = still
            depth += 1
        for r in requests:
            if r.key in kept:
                self._drop_kept(r, kept[r.key])
        if not (self.lookup and mode == "top"):
            return [self._to_draft(blocks[r.key], policies[r.key], mode) for r in requests]
        drafts = []
        for r in requests:
            block, policy = blocks[r.key], policies[r.key]
            branch = self._lookup_branch(r, min(r.k, policy.max_depth))
            if isinstance(policy, PCTPolicy) and policy.verify_cost is not None:
                # one selection over both branches: t(n) sizes the tree the target verifies
                drafts.append(self._to_draft(block, policy, mode, branch))
            else:
                drafts.append(self._with_lookup(self._to_draft(block, policy, mode), branch))
        return drafts

    # -- phases ----------------------------------------------------------------------------
    def _native(
        self, r: DraftRequest, block: _Block, policy: TreePolicy, mode: ChildSampling, params: SamplingParams
    ) -> bool:
        """Draft one stream's block in native calls (the depth loop below, for a stream whose children are the
        draft's top tokens, the coupled guess first where it has noise): a chain in one (``runner.draft_chain``), a
        tree in one for depth 1 and one a depth after it (``runner.draft_rows``, the nodes' keys and values in a
        scratch stream). The same forwards and ranks on the same inputs, so the same block (on a CPU with AMX, a
        draft's one-row forwards take the lanes and the depth loop may run more rows on the tiles: the two can round
        apart there, unverified for lack of such a CPU; verification is exact either way); False where the native
        loop is not built or q is filtered (top-k, top-p: the native head ranks softmax(logits / T) only)."""
        if not self.runner.drafts_natively or mode != "top" or params.top_p < 1.0:
            return False
        if params.top_k and params.top_k < self._head_ids.numel():
            return False
        tokens, embeds = self._catch_up(r)
        if embeds is None:  # VDM: the new tokens' and the pending token's embeddings
            embeds = self._embedding[torch.cat([tokens, torch.tensor(block.tokens)])]
        limit = min(r.k, policy.max_depth, self._room(r))
        k = min(policy.max_children, self._head_ids.numel())
        stream, chain = self._streams[r.key], _is_chain(policy)
        noise = self._noise(r, range(1, limit + 1 if chain else 2))
        drafted = self.runner.draft_chain(
            stream, embeds, limit if chain else 1, self._head_ids, k, params.temperature, noise
        )
        if drafted is None:
            return False
        self._committed[r.key] = r.tokens[:-1]
        probs, heads, own = drafted
        try:
            if chain:
                for depth in range(1, limit + 1):
                    at = slice(depth - 1, depth)
                    self._add(block, policy, depth, [0], probs[at], heads[at], own=own[at])
                self.forwards += limit
            else:
                self._native_tree(r, block, policy, k, limit, probs, heads, own, params.temperature)
        finally:
            self.runner.truncate(stream, self._committed[r.key].numel())  # the pending token, any chain: scratch
        return True

    def _noise(self, r: DraftRequest, depths: Sequence[int]) -> torch.Tensor | None:
        """(len(depths), head rows) float64: E at the positions of the children of each depth, for the coupled
        guess (None: a greedy stream, or coupling off)."""
        if not (self.coupled and r.noise is not None):
            return None
        return torch.stack([r.noise.at(r.position + depth - 1, self._head_ids) for depth in depths])

    def _native_tree(
        self,
        r: DraftRequest,
        block: _Block,
        policy: TreePolicy,
        k: int,
        limit: int,
        probs: torch.Tensor,  # (1, k): depth 1's children
        heads: torch.Tensor,
        own: torch.Tensor,  # (1, k): their own probabilities
        temperature: float,
    ) -> None:
        """Depths 1.. of a tree (depth 1's forward done, counted here): each runs the frontier nodes the policy
        expands, every node once, over the scratch entries of its ancestors (the depth loop runs them and their
        uncached ancestors below the kept path instead: the same columns in the same order)."""
        if self._scratch is None:
            self._scratch = self.runner.new_stream()
        entry: dict[int, int] = {}  # block node -> its entry in the scratch stream
        depth, read = 1, [0]
        self.forwards += 1
        try:
            while self._add(block, policy, depth, read, probs, heads, own=own) and depth < limit:
                depth += 1
                read = policy.frontier_to_expand(depth, self._frontier_conf(block))
                if not read:
                    break
                nodes = [block.frontier[j] for j in read]
                above = [self._scratch_path(block, node, entry) for node in nodes]
                noise = self._noise(r, [depth])
                probs, heads, own = self.runner.draft_rows(
                    self._streams[r.key], self._scratch, torch.tensor([block.tokens[v] for v in nodes]),
                    [depth - 1] * len(nodes), above, k, temperature, None if noise is None else noise[0],
                )  # fmt: skip
                entry.update({v: len(entry) + i for i, v in enumerate(nodes)})  # their scratch entries, in order
                self.forwards += 1
        finally:
            self.runner.truncate(self._scratch, 0)

    @staticmethod
    def _scratch_path(block: _Block, node: int, entry: dict[int, int]) -> list[int]:
        """The scratch entries of ``node``'s ancestors below the root, root first (each was expanded before)."""
        path = []
        while (node := block.parents[node]) > 0:
            path.append(entry[node])
        return path[::-1]

    def _forward_depth(
        self,
        active: list[DraftRequest],
        blocks: dict[int, _Block],
        expand: dict[int, list[int]],  # frontier indices to expand per stream
        kept: dict[int, list[int]],  # block nodes in each stream's draft cache (a root path)
        depth: int,
    ) -> list[torch.Tensor]:
        """One draft forward for every active stream: the logits of the nodes it expands. Depth 1 runs the
        catch-up entries and the pending token and keeps them; a later depth runs only the nodes to expand and
        their ancestors not yet in the cache (``_new_nodes``) and keeps the path to the likeliest of them, so a
        chain's depth is one row and a tree's a few (the whole block ran again at every depth before)."""
        if depth == 1:
            trees = [self._catch_up_tree(r, blocks[r.key]) for r in active]
            out = self.runner.forward(trees, logit_rows=[[len(st.tree) - 1] for st in trees])
            self.runner.commit({st.stream: range(len(st.tree)) for st in trees})
            for r in active:
                kept[r.key][:] = [0]
            return out.logits
        nodes = {r.key: [blocks[r.key].frontier[j] for j in expand[r.key]] for r in active}
        if len(active) == 1 and len(nodes[active[0].key]) == 1:  # one node of one stream below the kept path
            r, node = active[0], nodes[active[0].key][0]
            if kept[r.key] and blocks[r.key].parents[node] == kept[r.key][-1]:  # no tree to build
                kept[r.key].append(node)
                return [self.runner.forward_kept(self._streams[r.key], blocks[r.key].tokens[node])]
        trees, rows, keep = [], [], {}
        for r in active:
            block, stream = blocks[r.key], self._streams[r.key]
            held, run = _new_nodes(block.parents, kept[r.key], nodes[r.key])
            if held < len(kept[r.key]):  # cut the cache back to the kept nodes the new ones hang below
                self.runner.truncate(stream, self._committed[r.key].numel() + held)
                del kept[r.key][held:]
            index = {node: i for i, node in enumerate(run)}
            parents = [index.get(block.parents[node], -1) for node in run]
            tokens = torch.tensor([block.tokens[node] for node in run])
            trees.append(StreamTree(stream, TokenTree(tokens, torch.tensor(parents))))
            rows.append([index[node] for node in nodes[r.key]])
            path = [max(nodes[r.key], key=lambda node: block.conf[node])]  # the likeliest to be expanded next
            while path[-1] != run[0]:
                path.append(block.parents[path[-1]])
            keep[stream] = [index[node] for node in reversed(path)]
            kept[r.key].extend(reversed(path))
        out = self.runner.forward(trees, logit_rows=rows)
        self.runner.commit(keep)
        return out.logits

    def _catch_up_tree(self, r: DraftRequest, block: _Block) -> StreamTree:
        """Depth 1: the new committed entries then the pending token, one chain."""
        tokens, embeds = self._catch_up(r)
        return StreamTree(
            self._streams[r.key], TokenTree.chain(torch.cat([tokens, torch.tensor(block.tokens)])), embeds
        )

    def _drop_kept(self, r: DraftRequest, kept: list[int]) -> None:
        """Cut the draft's cache back to the committed entries (the block nodes in it are scratch)."""
        if kept:
            self.runner.truncate(self._streams[r.key], self._committed[r.key].numel())
            kept.clear()

    @staticmethod
    def _frontier_conf(block: _Block) -> torch.Tensor:
        return torch.tensor([block.conf[f] for f in block.frontier])

    def _catch_up(self, r: DraftRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The committed tokens the draft has not seen yet (all but the pending one) and, for EDD,
        the chain's input vectors: the target's hidden states of those tokens through the draft's
        projection, then the pending token's embedding."""
        tokens = r.tokens[self._committed[r.key].numel() : -1]
        if self._hidden_proj is None:
            return tokens, None
        # the request's hidden states end at the last committed token; a stream forked from a kept prefix
        # needs only the rows past it
        if r.hidden is None or r.hidden.shape[0] < tokens.numel():
            got = None if r.hidden is None else r.hidden.shape[0]
            raise RuntimeError(f"EDD needs the target's hidden states of {tokens.numel()} new tokens, got {got}")
        vectors = self.runner.linear(
            r.hidden[r.hidden.shape[0] - tokens.numel() :].to(self.runner.dtype), self._hidden_proj
        )  # W_h h_i
        # e(x_i) of the new tokens, then the pending token's: one gather serves W_c, W_n and the pending entry
        embedded = self._embedding[r.tokens[r.tokens.numel() - tokens.numel() - 1 :]].to(vectors.dtype)
        if self._current_proj is not None and tokens.numel():  # + W_c e(x_i)
            vectors = vectors + self.runner.linear(embedded[:-1], self._current_proj)
        if self._next_proj is not None and tokens.numel():  # + W_n e(x_{i+1}): each token's successor, pending last
            vectors = vectors + self.runner.linear(embedded[1:], self._next_proj)
        return tokens, torch.cat([vectors, embedded[-1:]])

    def _grow(
        self,
        block: _Block,
        policy: TreePolicy,
        depth: int,
        rows: list[int],  # frontier indices the logits belong to
        q_sub: torch.Tensor,  # (len(rows), head_vocab) draft probabilities
        mode: ChildSampling,
        generator: torch.Generator | None,
        noise: torch.Tensor | None = None,  # (head_vocab,) E of the children's position: ``top`` ranks its guess first
    ) -> bool:
        """Add the policy's children below the frontier; False when nothing was added."""
        k = min(policy.max_children, q_sub.shape[1])
        if mode == "top":
            probs, picks = q_sub.topk(k, dim=-1)  # (rows, K)
            if noise is not None:  # the guess first; the ranks keep the sorted values (largest first, as tree
                # policies read them): the guess is the child the target's draw most likely is, and its own q
                # understates that (a draft equal to the target is always right with the shared noise)
                picks = _coupled_first(q_sub, picks, noise)
                return self._add(block, policy, depth, rows, probs, picks, own=q_sub.gather(1, picks))
            return self._add(block, policy, depth, rows, probs, picks)
        picks = _draw(q_sub, k, mode == "without_replacement", generator)  # (rows, K)
        return self._add(block, policy, depth, rows, q_sub.gather(1, picks), picks, q_sub)

    def _add(
        self,
        block: _Block,
        policy: TreePolicy,
        depth: int,
        rows: list[int],  # frontier indices the candidates belong to
        probs: torch.Tensor,  # (len(rows), K) each candidate's draft probability, largest first under ``top``
        picks: torch.Tensor,  # (len(rows), K) the candidates' head rows
        q_sub: torch.Tensor | None = None,  # sampled children: the distributions they were drawn from
        own: torch.Tensor | None = None,  # (len(rows), K) the candidates' own probabilities where not ``probs``
    ) -> bool:
        """Append the policy's pick of the candidates below the frontier; False when it picked none."""
        k = probs.shape[1]
        if rows == list(range(len(block.frontier))):
            child_probs = probs
        else:  # rows the policy does not read stay 0
            child_probs = torch.zeros(len(block.frontier), k)
            child_probs[rows] = probs
        where = {fi: i for i, fi in enumerate(rows)}
        frontier = []
        prob_rows, pick_rows = probs.tolist(), picks.tolist()
        own_rows = prob_rows if own is None else own.tolist()
        for fi, rank in policy.expand(depth, self._frontier_conf(block), child_probs):
            parent, row = block.frontier[fi], where[fi]
            block.tokens.append(self._head_list[pick_rows[row][rank]])
            block.parents.append(parent)
            block.prob.append(prob_rows[row][rank])
            block.own.append(own_rows[row][rank])
            block.conf.append(block.conf[parent] * block.prob[-1])
            block.q.append(None if q_sub is None else q_sub[row])
            frontier.append(len(block.tokens) - 1)
        block.frontier = frontier
        return bool(frontier)

    def _to_draft(self, block: _Block, policy: TreePolicy, mode: ChildSampling, branch: Sequence[int] = ()) -> Draft:
        """The policy's pick of the block's nodes; with a lookup ``branch``, picked together with its nodes."""
        conf = block.conf
        if branch:
            conf = _graft_into(block, branch, self.lookup_accept)
        keep = policy.finalize(block.parents, conf)
        if keep[0] != 0:
            raise RuntimeError("a tree policy must keep the root")
        index = {old: new for new, old in enumerate(keep)}
        nodes = keep[1:]
        tokens = torch.tensor([block.tokens[i] for i in nodes], dtype=torch.int64)
        parent_list = [index[block.parents[i]] - 1 for i in nodes]
        parents = torch.tensor(parent_list, dtype=torch.int64)
        confidence = torch.tensor([block.own[i] for i in nodes])  # NaN on grafted nodes
        # a chain goes out as a chain: verified by the chain rules, cut and learnt by the adaptive length
        chain = parent_list == list(range(-1, len(nodes) - 1))
        if mode == "top" or not nodes:
            return Draft(tokens, None, None if chain else parents, confidence=confidence)
        q = torch.zeros(len(nodes), self._vocab)
        q[:, self._head_ids] = torch.stack([block.q[i] for i in nodes])
        if chain:
            return Draft(tokens, q, confidence=confidence)
        return Draft(tokens, q, parents, rule=mode, confidence=confidence)

    def _lookup_branch(self, r: DraftRequest, k: int) -> list[int]:
        """What the stream would copy: the continuation of a trailing match of >= ``lookup`` tokens ([] if none)."""
        branch, _ = lookup_match(r.tokens, min(k, self._room(r)), max(3, self.lookup), self.lookup)
        return branch.tolist()

    def _with_lookup(self, draft: Draft, branch: list[int]) -> Draft:
        """``draft`` with ``branch`` grafted below its root (grafted nodes have no draft confidence: NaN, left
        out of calibration). A chain it extends stays a chain."""
        if not branch:
            return draft
        chain = list(range(-1, draft.tokens.numel() - 1))
        parents = chain if draft.parents is None else draft.parents.tolist()
        tokens, parents, _ = graft(draft.tokens.tolist(), parents, branch)
        added = len(tokens) - draft.tokens.numel()  # graft appends the new nodes
        if not added:
            return draft
        confidence = torch.cat([draft.confidence, torch.full((added,), float("nan"))])
        as_tree = None if parents == list(range(-1, len(tokens) - 1)) else torch.tensor(parents)
        return Draft(torch.tensor(tokens, dtype=torch.int64), None, as_tree, confidence=confidence)

    def _with_unread(self, r: DraftRequest) -> DraftRequest:
        """``r`` with the hidden states earlier requests of its stream brought and no catch-up read, before its own."""
        unread = self._unread.pop(r.key, None)
        if unread is None:
            return r
        return replace(r, hidden=unread if r.hidden is None else torch.cat([unread, r.hidden]))

    def _policy_for(self, r: DraftRequest, streams: int = 1) -> TreePolicy:
        """The request's tree policy; a PCT policy priced for the ``streams`` drafting in this step."""
        if r.policy is not None:
            return r.policy
        if self.policy is None:
            return _chain_policy(max(r.k, 1))
        if isinstance(self.policy, PCTPolicy):
            return _pct_for_streams(self.policy, streams)
        return self.policy

    def _fits_head(self, policy: TreePolicy | None) -> None:
        """A tree wider than the draft's head asks for children it cannot name (an IndexError mid-draft)."""
        if policy is not None and policy.max_children > len(self._head_list):
            raise ValueError(
                f"the tree asks for {policy.max_children} children per node but the draft head holds "
                f"{len(self._head_list)} tokens: raise --draft-head (0: the whole head) or narrow the tree"
            )

    def _room(self, r: DraftRequest) -> int:
        return self.runner.max_context - r.tokens.numel()

    def release(self, key: int, keep: bool = True) -> None:
        """The stream is done: its draft KV goes to the prefix cache (which frees it when it needs the room), or
        is freed (``keep=False``: a failed step's)."""
        self._unread.pop(key, None)
        if key in self._streams:
            sid, committed = self._streams.pop(key), self._committed.pop(key)
            if keep:
                self.prefixes.keep(sid, committed.tolist())
            else:
                self.runner.release(sid)


def _is_chain(policy: TreePolicy) -> bool:
    """Whether the policy grows one child of the one frontier node at every depth and keeps every node."""
    return isinstance(policy, StaticPolicy) and policy.shape == tuple(range(-1, len(policy.shape) - 1))


@lru_cache(maxsize=64)  # one per (policy, batch size): a step does not rebuild it
def _pct_for_streams(policy: PCTPolicy, streams: int) -> PCTPolicy:
    return policy.for_streams(streams)


@cache  # a static policy only reads its shape: one per chain length serves every step
def _chain_policy(k: int) -> StaticPolicy:
    return StaticPolicy(tuple(chain_tree(k)))


def _graft_into(block: _Block, branch: Sequence[int], accept: float) -> list[float]:
    """Hang ``branch`` below the block's root, sharing the nodes it agrees with (grafted nodes: NaN draft
    probability, no q), and return every node's path confidence for a joint selection:

        f(v) = f(parent) * max(p(v), a)   on the branch      (a: the lookup's per-token acceptance)
        f(v) = f(parent) * p(v)           elsewhere           (p: the draft's probability, NaN -> 0)

    so a node both predict counts once, at its likelier estimate, and its draft children inherit it.
    Parents precede children, so one pass computes f. Worked example, a = 0.5: block root -> x (p 0.8)
    -> y (p 0.6), branch [x, z]: z is new, f = [1, 0.8, 0.48, 0.4] for [root, x, y, z].
    """
    # graft works on the tree below the root: node v of the block is node v - 1 there
    tokens, parents, path = graft(block.tokens[1:], [p - 1 for p in block.parents[1:]], list(branch))
    for v in range(len(block.tokens) - 1, len(tokens)):
        block.tokens.append(tokens[v])
        block.parents.append(parents[v] + 1)
        block.prob.append(float("nan"))
        block.own.append(float("nan"))
        block.conf.append(0.0)
        block.q.append(None)
    on_branch = {v + 1 for v in path}
    conf = [1.0]
    for v in range(1, len(block.tokens)):
        p = 0.0 if math.isnan(block.prob[v]) else block.prob[v]
        conf.append(conf[block.parents[v]] * (max(p, accept) if v in on_branch else p))
    return conf


def _coupled_first(q: torch.Tensor, top: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(rows, K) children: each row's guess argmax q / E first (the token the target's own draw with noise E
    most likely is, ``sampling.coupled_pick``), then the row's other top tokens in order.

    Example: top [[7, 3, 9]], guess 9 -> [[9, 7, 3]]; guess 3 -> [[3, 7, 9]]."""
    guess = coupled_pick(q, noise).tolist()
    rows = [[g] + [t for t in row if t != g][: len(row) - 1] for g, row in zip(guess, top.tolist())]
    return torch.tensor(rows, dtype=torch.int64)


def _draw(q: torch.Tensor, k: int, distinct: bool, generator: torch.Generator | None) -> torch.Tensor:
    """(m, V) distributions -> (m, k) token indices: i.i.d. draws, or k distinct draws in the order
    sequential sampling without replacement would give them (Gumbel top-k: the k largest
    log q + Gumbel noise, equivalently q / Exp(1))."""
    if distinct:
        return (q / torch.empty_like(q).exponential_(generator=generator)).topk(k, dim=-1).indices
    return torch.stack([(q / torch.empty_like(q).exponential_(generator=generator)).argmax(-1) for _ in range(k)], 1)


def _new_nodes(parents: Sequence[int], kept: Sequence[int], expand: Sequence[int]) -> tuple[int, list[int]]:
    """(h, run): how many of the ``kept`` nodes (a root path of the block, in the draft's cache) stay, and the
    block nodes a forward runs so that every node of ``expand`` gets its logits: the nodes of their paths below
    kept[:h], ascending (parents first). h is the longest prefix of ``kept`` on every such path, one shorter
    where the paths would part right below it, so that ``run`` hangs from one root (a token tree has one).
    Example: parents [-1, 0, 0, 1, 1] and kept [0, 1]: expand [3, 4] -> (1, [1, 3, 4]) (3 and 4 would be two
    roots below 1), expand [4] -> (2, [4]), expand [2] -> (1, [2])."""
    paths = []
    for node in expand:
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    held = 0
    while held < len(kept) and all(len(path) > held + 1 and path[held] == kept[held] for path in paths):
        held += 1
    if len({path[held] for path in paths}) > 1:  # the paths part right below kept[:held]: run their fork too
        held -= 1
    return held, sorted({node for path in paths for node in path[held:]})
