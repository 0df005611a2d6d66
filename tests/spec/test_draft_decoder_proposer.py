"""DraftDecoderProposer: drafting chains and trees with an EDD or VDM draft is lossless.

- greedy decoding with every tree policy is token for token greedy AR (tiny fp32 llama targets);
- the proposer drafts what the teacher-forced draft predicts (inference == training forward);
- sampled trees (children drawn with or without replacement) leave the target's joint distribution
  of the generated tokens unchanged: chi-square against the exact joint from the target's logits;
- a batch of streams decodes exactly as each stream alone;
- EDD without the target's hidden states is refused.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from spectot.engine.runner import ModelRunner, SpectotMatmul, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint
from spectot.spec.decoding import DecodeConfig, Decoder, StreamResult
from spectot.spec.draft_length import DraftLength
from spectot.spec.proposers.base import DraftRequest
from spectot.spec.proposers.draft_decoder import DraftDecoderProposer, _new_nodes
from spectot.spec.sampling import CoupledNoise, SamplingParams, target_probs
from spectot.spec.trees.dynamic import CAPEPolicy, EAGLE2Policy, PCTPolicy, StaticPolicy, VCTPolicy
from spectot.spec.trees.sequoia import sequoia_tree
from spectot.spec.trees.shapes import k_config_tree

HIDDEN_LAYER = -2
PROMPTS = [[5], [3, 17, 42, 8], [21, 9, 60, 2, 2, 14, 33, 7, 50, 11, 38]]
MAX_NEW = 24
HEAD_IDS = torch.tensor(sorted(set(range(0, 64, 3)) | set(range(1, 64, 4))))  # 38 of the 64 tokens

POLICIES = {
    "chain": None,
    "k_config": StaticPolicy(tuple(k_config_tree((2, 2, 1)))),
    "sequoia": StaticPolicy(tuple(sequoia_tree([0.6, 0.2, 0.1], 10).parents)),
    "pct": PCTPolicy(threshold=0.05),
    "vct": VCTPolicy(),
    "cape": CAPEPolicy(),
    "eagle2": EAGLE2Policy(top_k=3, depth=3, total_tokens=8),
}


def make_draft(target, kind: str, head_ids: torch.Tensor, num_layers: int = 1) -> DraftDecoder:
    """kind edd, vdm, edd+next (hidden entries also read the next token) or edd+copy (the next token and their own);
    the token inputs get random weights, so they count."""
    config = DraftDecoderConfig(
        kind.split("+")[0],
        num_layers,
        HIDDEN_LAYER if kind.startswith("edd") else None,
        head_ids.numel(),
        fingerprint(target),
        target.config.to_dict(),
        next_token=kind.endswith(("+next", "+copy")),
        current_token=kind.endswith("+copy"),
    )
    draft = DraftDecoder.initialise(config, target, head_ids).eval()
    for proj, seed in ((draft.next_proj, 0), (draft.current_proj, 1)):
        if proj is not None:
            with torch.no_grad():
                proj.weight.copy_(0.5 * torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return draft


def proposer(
    draft: DraftDecoder, policy=None, children: str = "top", prefix_tokens: int = 16384
) -> DraftDecoderProposer:
    return DraftDecoderProposer(draft, ModelRunner(draft.model), policy, children, prefix_tokens=prefix_tokens)


def decode(target, prompts, prop=None, **config) -> list[StreamResult]:
    method = "ar" if prop is None else "sd"
    return Decoder(ModelRunner(target), proposer=prop).generate(prompts, DecodeConfig(method=method, **config))


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(0, num_hidden_layers=3)


@pytest.fixture(scope="module")
def ar_tokens(target) -> list[list[int]]:
    return [r.token_ids for r in decode(target, PROMPTS, max_new_tokens=MAX_NEW)]


@pytest.fixture(scope="module")
def drafts(target) -> dict[str, DraftDecoder]:
    return {kind: make_draft(target, kind, HEAD_IDS) for kind in ("edd", "vdm", "edd+next", "edd+copy")}


# -- greedy: token for token AR --------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", ["edd", "vdm", "edd+next", "edd+copy"])
def test_greedy_decoding_equals_ar(target, ar_tokens, drafts, kind: str, policy: str) -> None:
    prop = proposer(drafts[kind], POLICIES[policy])
    out = decode(target, PROMPTS, prop, max_new_tokens=MAX_NEW, num_draft_tokens=5)
    assert [r.token_ids for r in out] == ar_tokens
    assert all(r.stats.proposed > 0 for r in out)  # drafts were verified, not skipped
    assert prop._streams == {}  # every draft stream released: to the draft's prefix cache, which holds the rest
    prop.prefixes.clear()
    assert prop.runner.cache.used == 0


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_decoding_with_a_draft_that_always_agrees(tiny_llama, policy: str) -> None:
    """A one-layer target and a VDM copy of it with the whole vocabulary as head: the draft is the
    target, so its top-1 drafts are accepted and long drafts are emitted."""
    target = tiny_llama(0, num_hidden_layers=1)
    draft = make_draft(target, "vdm", torch.arange(64))
    ar = [r.token_ids for r in decode(target, PROMPTS, max_new_tokens=MAX_NEW)]
    out = decode(target, PROMPTS, proposer(draft, POLICIES[policy]), max_new_tokens=MAX_NEW, num_draft_tokens=4)
    assert [r.token_ids for r in out] == ar
    for r in out:
        assert r.stats.mean_acceptance_length > 1.5
        # every node with children on the accepted path passed it on through the draft's first-ranked child
        assert r.stats.accepted_rank[0] == r.stats.rank_visits[0] > 0 and not any(r.stats.accepted_rank[1:])
        if policy in ("chain", "k_config", "sequoia"):
            # static shapes always hold the rank-0 chain, so every depth reached is accepted; confidence-ranked
            # trees (VCT, EAGLE-2, ...) may drop the rank-0 path in favour of more confident branches
            assert r.stats.accepted_by_position == r.stats.reached_by_position


# -- sampled, deterministic drafts: guessed with the target's own noise ------------------------------


@pytest.mark.parametrize("policy", ["chain", "k_config", "pct"])
def test_sampled_decoding_with_coupled_guesses_equals_ar(target, drafts, policy: str) -> None:
    """T = 1, top-ranked drafts whose first rank is the guess argmax q / E_j: the output is ar's own sample,
    token for token, for the same seeds."""
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    ar = [r.token_ids for r in decode(target, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling, seed=3)]
    prop = proposer(drafts["edd"], POLICIES[policy])
    out = decode(target, PROMPTS, prop, max_new_tokens=MAX_NEW, num_draft_tokens=3, sampling=sampling, seed=3)
    assert [r.token_ids for r in out] == ar
    assert all(r.stats.proposed > 0 for r in out)


def test_a_draft_equal_to_the_target_is_nearly_always_accepted_at_temperature_one(tiny_llama) -> None:
    """The draft is the target (a one-layer VDM copy, whole vocabulary): guessed with the target's noise, each
    drafted token is the target's own draw, so nearly every one is accepted; the draft's argmax would land
    only with the target's probability of it."""
    target = tiny_llama(0, num_hidden_layers=1)
    draft = make_draft(target, "vdm", torch.arange(64))
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    ar = [r.token_ids for r in decode(target, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling)]
    out = decode(target, PROMPTS, proposer(draft), max_new_tokens=MAX_NEW, num_draft_tokens=4, sampling=sampling)
    assert [r.token_ids for r in out] == ar
    proposed, accepted = sum(r.stats.proposed for r in out), sum(r.stats.accepted for r in out)
    assert proposed > 0 and accepted >= 0.95 * proposed


class SortedCheck(PCTPolicy):
    """PCT that checks the drafter's contract: child_probs sorted largest first in every row."""

    def expand(self, depth, path_conf, child_probs):
        assert bool((child_probs[:, :-1] >= child_probs[:, 1:]).all()), child_probs
        self.rows_seen.append(child_probs.shape[0])
        return super().expand(depth, path_conf, child_probs)


def test_coupled_guesses_keep_the_tree_policies_sorted_children(target, drafts) -> None:
    """The guess argmax q / E_j comes first even where its own q is small; a dynamic policy (PCT, CAPE,
    EAGLE-2) still reads each row's child probabilities largest first, so it never prunes the guess for its q."""
    policy = SortedCheck(threshold=0.05)
    object.__setattr__(policy, "rows_seen", [])
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    ar = [r.token_ids for r in decode(target, PROMPTS, max_new_tokens=MAX_NEW, sampling=sampling, seed=4)]
    out = decode(target, PROMPTS, proposer(drafts["edd"], policy), max_new_tokens=MAX_NEW, sampling=sampling, seed=4)
    assert [r.token_ids for r in out] == ar and sum(policy.rows_seen) > 0


def test_coupled_first_puts_the_guess_first_and_keeps_the_other_top_tokens() -> None:
    from spectot.spec.proposers.draft_decoder import _coupled_first

    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    top = q.topk(3, -1).indices  # [[3, 2, 1], [0, 1, 2]]
    noise = torch.tensor([1.0, 1.0, 0.01, 1.0], dtype=torch.float64)  # token 2 wins both races
    assert _coupled_first(q, top, noise).tolist() == [[2, 3, 1], [2, 0, 1]]
    assert _coupled_first(q, top, torch.ones(4, dtype=torch.float64)).tolist() == top.tolist()  # E = 1: argmax


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=1.0)])
def test_adaptive_length_learns_from_draft_decoder_chains(target, drafts, sampling: SamplingParams) -> None:
    """A draft decoder's chains reach the adaptive draft length's estimate (they once went out as
    one-child trees, which it never observed: k stayed at the prior's choice whatever was accepted)."""
    length = DraftLength(lambda n: 1.0, draft_cost=0.0, learn_cost=False)
    decoder = Decoder(ModelRunner(target), proposer=proposer(drafts["edd"]), draft_length=length)
    decoder.generate(PROMPTS, DecodeConfig(method="sd", max_new_tokens=MAX_NEW, num_draft_tokens=4, sampling=sampling))
    (estimate,) = length.estimates.values()
    assert estimate.reached and estimate.reached[0] > 0


def fanning_length() -> DraftLength:
    """An adaptive length that verifies its first token's runners-up: cheap rows, a prior that says they land."""
    return DraftLength(
        lambda n: 1.0 + 0.01 * (n - 1),
        draft_cost=0.05,
        learn_cost=False,
        max_width=3,
        runner_up_priors={0.0: [0.3, 0.2], 1.0: [0.3, 0.2]},
    )


@pytest.mark.parametrize("kind", ["edd", "vdm"])
def test_greedy_decoding_with_adaptive_fans_equals_ar(target, ar_tokens, drafts, kind: str) -> None:
    """The adaptive length's fans (runners-up of the first token beside the chain) are verified, learnt from,
    and leave greedy output token for token AR's."""
    length = fanning_length()
    decoder = Decoder(ModelRunner(target), proposer=proposer(drafts[kind]), draft_length=length)
    out = decoder.generate(PROMPTS, DecodeConfig(method="sd", max_new_tokens=MAX_NEW, num_draft_tokens=4))
    assert [r.token_ids for r in out] == ar_tokens
    (ranks,) = length.runners_up.values()
    assert ranks.reached and ranks.reached[0] > 0  # fans went out and were verified


# -- the prompt-lookup branch ----------------------------------------------------------------------

REPEATING = [[3, 17, 42, 8, 3, 17], [21, 9, 60, 2, 21, 9, 60, 2, 21], [5, 6, 7, 5, 6, 7, 5]]


def test_lookup_branch_is_grafted_below_the_drafts_chain(target, drafts) -> None:
    """The trailing [3, 17] occurred at 0, followed by [42, 8, 3]: that branch hangs from the root beside the
    draft's own chain, which keeps its tokens and confidences; the grafted nodes carry no confidence (NaN)."""
    tokens = torch.tensor(REPEATING[0])
    with torch.no_grad():
        hidden = target(tokens[None].to(target.device), output_hidden_states=True).hidden_states[HIDDEN_LAYER][0]
    request = DraftRequest(0, tokens, 3, hidden[:-1])
    (plain,) = proposer(drafts["edd"]).propose([request], SamplingParams(), None)
    grafted = proposer(drafts["edd"])
    grafted.lookup = 2
    (d,) = grafted.propose([request], SamplingParams(), None)
    assert plain.parents is None and plain.tokens.numel() == 3
    tree = d.tree(root=17)
    paths = {tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(len(tree))}
    assert (17, 42, 8, 3) in paths and (17, *plain.tokens.tolist()) in paths
    assert d.tokens[:3].equal(plain.tokens) and d.confidence[:3].equal(plain.confidence)
    new = d.tokens.numel() - 3
    assert new >= 1 and torch.isnan(d.confidence[3:]).all() and d.confidence[3:].numel() == new
    # a match shorter than asked for grafts nothing: [17] alone is a 1-gram
    (short,) = grafted.propose([DraftRequest(1, torch.tensor([9, 17, 4, 17]), 3, hidden[:3])], SamplingParams(), None)
    assert short.parents is None and short.tokens.numel() == 3


@pytest.mark.parametrize("policy", ["chain", "pct"])
@pytest.mark.parametrize("kind", ["edd", "vdm"])
def test_greedy_decoding_with_the_lookup_branch_equals_ar(target, drafts, kind: str, policy: str) -> None:
    ar = [r.token_ids for r in decode(target, REPEATING, max_new_tokens=MAX_NEW)]
    config = {"max_new_tokens": MAX_NEW, "num_draft_tokens": 5}
    plain = decode(target, REPEATING, proposer(drafts[kind], POLICIES[policy]), **config)
    prop = proposer(drafts[kind], POLICIES[policy])
    prop.lookup = 1
    out = decode(target, REPEATING, prop, **config)
    assert [r.token_ids for r in out] == ar

    def nodes_per_step(results: list[StreamResult]) -> float:
        return sum(r.stats.proposed for r in results) / sum(r.stats.verify_steps for r in results)

    assert nodes_per_step(out) > nodes_per_step(plain)  # the branches were verified beside the draft's trees


@pytest.mark.parametrize("kind", ["edd+copy", "vdm"])
def test_bf16_drafts_on_spectots_kernels_decode_as_ar(tiny_model, kind: str) -> None:
    """The benchmarks' setting end to end: a bf16 target and draft on spectot's kernels (the native layer loop where
    it builds), chains, PCT trees and lookup branches; greedy SD is bf16 AR token for token (the kernels are
    batch-invariant). The bf16 draft paths had no test before; a zero-row call into the bf16 linear (below) was
    found by a benchmark's crash, and without its early return this test crashes too."""
    model = tiny_model.__wrapped__("llama", 0, num_hidden_layers=3).to(torch.bfloat16)  # a fresh copy: stays bf16
    draft = make_draft(model, kind, HEAD_IDS).to(torch.bfloat16)
    target_runner = ModelRunner(model, kernels="spectot")
    if not isinstance(target_runner._linear, SpectotMatmul):
        pytest.skip("spectot's bf16 kernels need an x86 CPU with AVX2 + FMA and a C++ toolchain")
    prompts = PROMPTS + REPEATING
    ar = Decoder(target_runner).generate(prompts, DecodeConfig(method="ar", max_new_tokens=MAX_NEW))
    for policy, lookup in (("chain", 0), ("pct", 0), ("pct", 1), ("chain", 1)):
        prop = DraftDecoderProposer(draft, ModelRunner(draft.model, kernels="spectot"), POLICIES[policy], lookup=lookup)
        decoder = Decoder(ModelRunner(model, kernels="spectot"), proposer=prop)
        out = decoder.generate(prompts, DecodeConfig(method="sd", max_new_tokens=MAX_NEW, num_draft_tokens=5))
        assert [r.token_ids for r in out] == [r.token_ids for r in ar], (policy, lookup)
        assert sum(r.stats.accepted for r in out) > 0  # drafts were accepted, not only verified
    # a search's prompts extend earlier ones: the draft forks its kept prefix, and a fork that covers every
    # committed token leaves an empty catch-up (zero rows into the bf16 linear: it once crashed there)
    extended = [p + r.token_ids[:n] for p, r in zip(prompts, ar) for n in (3, 11)]
    ar = Decoder(target_runner).generate(extended, DecodeConfig(method="ar", max_new_tokens=8))
    out = decoder.generate(extended, DecodeConfig(method="sd", max_new_tokens=8, num_draft_tokens=5))
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]


@pytest.mark.parametrize("temperature", [0.0, 0.7])  # greedy; sampled, the coupled guess first
@pytest.mark.parametrize("policy", ["chain", "pct", "k_config", "eagle2"])
@pytest.mark.parametrize("kind", ["edd+copy", "vdm"])
def test_native_drafts_are_the_depth_loops(tiny_model, kind: str, policy: str, temperature: float) -> None:
    """One stream drafting top tokens drafts in native calls: a chain in one (``runner.draft_chain``), a tree in
    one for depth 1 and one a depth after it (``runner.draft_rows``, every node run once over its ancestors'
    scratch entries). Over whole generations every draft (tokens and draft probabilities) must be the one the
    depth-by-depth loop makes, which runs where the native loop is not built (``draft_chain`` returns None):
    greedy, and sampled at T = 0.7 (q at the stream's temperature, each depth's guess argmax q / E first)."""
    model = tiny_model.__wrapped__("llama", 0, num_hidden_layers=3).to(torch.bfloat16)
    draft = make_draft(model, kind, HEAD_IDS).to(torch.bfloat16)
    if ModelRunner(draft.model, kernels="spectot")._stack is None:
        pytest.skip("the native layer loop did not build here")

    results = []
    for native in (True, False):
        tree = TREES[policy] if policy == "pct" else POLICIES[policy]
        prop = DraftDecoderProposer(draft, ModelRunner(draft.model, kernels="spectot"), tree)
        results.append(_record_drafts(prop, model, native, SamplingParams.from_temperature(temperature)))
    (native_drafts, native_calls), (loop_drafts, _) = results
    assert native_drafts == loop_drafts and len(native_drafts) > 10
    assert native_calls > len(native_drafts) // 2  # the steps that drafted at all asked for it


def _record_drafts(
    prop: DraftDecoderProposer, model: torch.nn.Module, native: bool, sampling: SamplingParams
) -> tuple[list, int]:
    """Every draft ``prop`` makes over greedy SD of each prompt alone (the native calls draft for one stream), and
    how often it asked the runner for them (which, with ``native`` False, declines as an unbuilt one)."""
    chain, propose = prop.runner.draft_chain, prop.propose
    calls, made = [], []

    def draft_chain(*args: object) -> tuple[list[int], list[float]] | None:
        calls.append(1)
        return chain(*args) if native else None

    def recording(*args: object) -> list:
        out = propose(*args)
        made.extend((d.tokens.tolist(), d.confidence.tolist()) for d in out)
        return out

    prop.runner.draft_chain, prop.propose = draft_chain, recording
    decoder = Decoder(ModelRunner(model, kernels="spectot"), proposer=prop)
    for seed, prompt in enumerate(PROMPTS + REPEATING):
        config = DecodeConfig(method="sd", max_new_tokens=MAX_NEW, num_draft_tokens=5, sampling=sampling, seed=seed)
        decoder.generate([prompt], config)
    return made, len(calls)


def test_sampled_decoding_with_the_lookup_branch_keeps_the_target_joint(dist_target) -> None:
    """T = 1, the draft's top-token chain plus the grafted branch (both deterministic): the joint of
    (x1, x2, x3) over 1800 seeded draws against the exact joint, as for the sampled trees below."""
    params = SamplingParams(do_sample=True, temperature=1.0)
    prop = proposer(make_draft(dist_target, "edd", torch.arange(DIST_VOCAB)))
    prop.lookup = 1
    decoder = Decoder(ModelRunner(dist_target), proposer=prop)
    counts: Counter = Counter()
    trees = 0
    for seed in range(DIST_CALLS):
        config = DecodeConfig(max_new_tokens=DIST_NEW, sampling=params, method="sd", num_draft_tokens=2, seed=seed)
        for r in decoder.generate([DIST_PROMPT_REPEATING] * DIST_STREAMS, config):
            counts[tuple(r.token_ids[:JOINT])] += 1
            trees += r.stats.proposed > 2  # more than the chain's 2 nodes: a branch was grafted
    assert trees > DIST_CALLS * DIST_STREAMS // 10
    exact = exact_joint(dist_target, DIST_PROMPT_REPEATING, JOINT, params)
    assert chi_square_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("kind", ["edd", "vdm", "edd+next", "edd+copy"])
def test_greedy_chain_is_the_argmax_of_the_teacher_forced_draft(target, drafts, kind: str) -> None:
    draft = drafts[kind]
    tokens = torch.tensor([3, 17, 42, 8, 21, 9, 60])  # the last one is the pending token
    with torch.no_grad():
        hidden = target(tokens[None].to(target.device), output_hidden_states=True).hidden_states[HIDDEN_LAYER][0]
    request = DraftRequest(0, tokens, 4, hidden[:-1] if kind != "vdm" else None)
    prop = proposer(draft)
    (chain,) = prop.propose([request], SamplingParams(), None)
    assert chain.parents is None and chain.tokens.numel() == 4 and chain.q is None  # a chain, deterministic
    # each depth ran one row over the nodes kept in the draft's cache; afterwards it holds the committed tokens only
    assert prop.runner.length(prop._streams[0]) == tokens.numel() - 1
    # teacher forcing: the block [pending, d1, d2, d3] after the hidden states of the committed tokens
    s = tokens.numel() - 1
    seq = torch.cat([tokens, chain.tokens[:-1]])
    starts = torch.cat([torch.zeros(s, dtype=torch.int64), torch.full((4,), s)])
    full_hidden = torch.cat([hidden[:s], torch.zeros(4, hidden.shape[1])])[None]  # unseen past s
    with torch.no_grad():
        logits = draft(seq[None], full_hidden if kind != "vdm" else None, starts)[0, s:]
    assert chain.tokens.tolist() == HEAD_IDS[logits.argmax(-1)].tolist()


TREES = {**POLICIES, "pct": PCTPolicy(threshold=0.0, max_depth=4, max_nodes=24)}  # a tiny random draft is unsure


@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("policy", ["k_config", "sequoia", "pct", "vct", "eagle2"])
@pytest.mark.parametrize("kind", ["edd", "vdm"])
def test_tree_nodes_carry_the_teacher_forced_draft_probability(
    target, drafts, kind: str, policy: str, coupled: bool
) -> None:
    """A tree's depths run only their new nodes over the ancestors kept in the draft's cache (cut back where a
    depth expands other branches): every node's draft probability must still be the teacher-forced draft's at
    its parent's path, as if the whole path ran from scratch. Sampled with coupled guesses (T = 1), a guess
    ranked first is still given its own probability (it was given the largest of its siblings')."""
    draft = drafts[kind]
    tokens = torch.tensor([3, 17, 42, 8, 21, 9, 60])  # the last one is the pending token
    with torch.no_grad():
        hidden = target(tokens[None].to(target.device), output_hidden_states=True).hidden_states[HIDDEN_LAYER][0]
    prop = proposer(draft, TREES[policy])
    sampling, noise = (SamplingParams(do_sample=True, temperature=1.0), CoupledNoise(3)) if coupled else (None, None)
    request = DraftRequest(0, tokens, 5, hidden[:-1] if kind != "vdm" else None, noise=noise, position=2)
    (tree,) = prop.propose([request], sampling or SamplingParams(), None)
    parents = tree.parents.tolist()
    assert max(parents) > 0 and len(set(parents)) < len(parents)  # two depths or more, and a fork
    assert prop.runner.length(prop._streams[0]) == tokens.numel() - 1  # only the committed tokens stay
    s = tokens.numel() - 1
    for node, parent in enumerate(parents):
        path = []
        while parent >= 0:
            path.insert(0, int(tree.tokens[parent]))
            parent = parents[parent]
        seq = torch.cat([tokens, torch.tensor(path, dtype=torch.int64)])  # the block: pending token, then the path
        block = seq.numel() - s
        starts = torch.cat([torch.zeros(s, dtype=torch.int64), torch.full((block,), s)])
        full_hidden = torch.cat([hidden[:s], torch.zeros(block, hidden.shape[1])])[None]
        with torch.no_grad():
            logits = draft(seq[None], full_hidden if kind != "vdm" else None, starts)[0, -1]
        q = logits.softmax(-1)
        token = int(tree.tokens[node])
        expected = float(q[(HEAD_IDS == token).nonzero()[0, 0]])
        assert abs(float(tree.confidence[node]) - expected) < 1e-5, (node, path)


def test_new_nodes_runs_the_paths_below_the_kept_nodes_from_one_root() -> None:
    parents = [-1, 0, 0, 1, 1, 3]
    assert _new_nodes(parents, [0, 1], [3, 4]) == (1, [1, 3, 4])  # 3 and 4 part right below node 1
    assert _new_nodes(parents, [0, 1], [4]) == (2, [4])  # below the kept path: one row
    assert _new_nodes(parents, [0, 1], [2]) == (1, [2])  # another branch: node 1 leaves the cache
    assert _new_nodes(parents, [0, 1, 3], [5]) == (3, [5])
    assert _new_nodes(parents, [0, 1, 3], [2, 5]) == (0, [0, 1, 2, 3, 5])  # they part at the root: run it again
    assert _new_nodes(parents, [0], [1, 2]) == (0, [0, 1, 2])


# -- batching --------------------------------------------------------------------------------------


def stats_of(r: StreamResult) -> tuple:
    s = r.stats
    return (
        s.proposed,
        s.accepted,
        s.verify_steps,
        s.reached_by_position,
        s.accepted_by_position,
        s.accepted_rank,
        s.rank_visits,
    )


@pytest.mark.parametrize("policy", ["pct", "eagle2"])
def test_batch_equals_each_stream_alone(target, ar_tokens, policy: str) -> None:
    draft = make_draft(target, "edd", torch.arange(64))
    prop = proposer(draft, POLICIES[policy])
    together = decode(target, PROMPTS, prop, max_new_tokens=MAX_NEW, num_draft_tokens=5)
    alone = [decode(target, [p], prop, max_new_tokens=MAX_NEW, num_draft_tokens=5)[0] for p in PROMPTS]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone] == ar_tokens
    assert [stats_of(r) for r in together] == [stats_of(r) for r in alone]
    assert sum(r.stats.accepted for r in together) > 0  # acceptance bookkeeping was exercised


# -- EDD needs the target's hidden states ----------------------------------------------------------


def test_edd_without_hidden_states_is_refused(drafts) -> None:
    prop = proposer(drafts["edd"])
    tokens = torch.tensor([3, 17, 42])
    with pytest.raises(RuntimeError, match="hidden states of 2 new tokens, got None"):
        prop.propose([DraftRequest(0, tokens, 3, None)], SamplingParams(), None)
    prop.release(0)
    with pytest.raises(RuntimeError, match="hidden states of 2 new tokens, got 1"):
        prop.propose([DraftRequest(0, tokens, 3, torch.zeros(1, 32))], SamplingParams(), None)


def test_decoder_passes_the_proposers_hidden_layer(drafts) -> None:
    assert Decoder(ModelRunner(drafts["edd"].model), proposer=proposer(drafts["edd"])).hidden_layer == HIDDEN_LAYER
    assert Decoder(ModelRunner(drafts["vdm"].model), proposer=proposer(drafts["vdm"])).hidden_layer is None


# -- sampled trees: the target's distribution, exactly ---------------------------------------------

DIST_VOCAB = 8
DIST_PROMPT = [1, 2, 3]
DIST_PROMPT_REPEATING = [1, 2, 3, 4, 1, 2, 5, 1]  # every token of the vocabulary's first half recurs
# x1 comes from the prefill; with 4 new tokens the next step drafts a depth-2 tree (the decoder never
# drafts the last token of the budget), so x2 and x3 are accepted or recovered tokens of that tree
DIST_NEW = 4
JOINT = 3  # compare the joint of x1, x2, x3
DIST_STREAMS = 30  # streams per generate call: each is an independent draw
DIST_CALLS = 60  # seeds 0..59: 1800 draws


@pytest.fixture(scope="module")
def dist_target(tiny_llama):
    # a wider init than the default: peaked distributions, and an EDD that often disagrees with the target
    return tiny_llama(0, vocab_size=DIST_VOCAB, initializer_range=0.2)


@torch.no_grad()
def exact_joint(model, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n) = prod_i p(x_i | prompt, x_<i) after temperature, from transformers' logits."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        prefixes = list(probs)
        logits = model(torch.tensor([prompt + list(s) for s in prefixes], device=model.device)).logits[:, -1].cpu()
        p = target_probs(logits, params).double()
        probs = {s + (v,): probs[s] * float(p[i, v]) for i, s in enumerate(prefixes) for v in range(DIST_VOCAB)}
    return probs


def marginal(table: dict[tuple[int, ...], float], keep: slice) -> dict[tuple[int, ...], float]:
    out: Counter = Counter()
    for s, v in table.items():
        out[s[keep]] += v
    return dict(out)


def chi_square_pvalue(counts: dict[tuple[int, ...], float], exact: dict[tuple[int, ...], float]) -> float:
    """Pearson's test on every cell, the cells expected fewer than 5 times pooled into one."""
    n = sum(counts.values())
    assert {s for s, c in counts.items() if c} <= {s for s, p in exact.items() if p > 0}
    big = [s for s in exact if exact[s] * n >= 5]
    small = [s for s in exact if exact[s] * n < 5]
    observed = [counts.get(s, 0) for s in big] + ([sum(counts.get(s, 0) for s in small)] if small else [])
    expected = [exact[s] * n for s in big] + ([sum(exact[s] for s in small) * n] if small else [])
    assert len(big) >= 20  # enough cells for the test to have power
    total = sum(expected)
    return float(chisquare(observed, [e * n / total for e in expected]).pvalue)


@pytest.mark.parametrize(
    "children, temperature, head",
    [
        ("without_replacement", 1.0, DIST_VOCAB),
        ("with_replacement", 1.0, DIST_VOCAB),
        # q is 0 outside a head of 5 of the 8 tokens: those are never drafted, only recovered
        ("without_replacement", 0.7, 5),
    ],
)
def test_sampled_trees_keep_the_target_joint(dist_target, children: str, temperature: float, head: int) -> None:
    """The issue's exact joint table: 1800 seeded draws of (x1, x2, x3) against the exact joint,
    and each neighbouring pair against its marginal. Broken variants it rejects (p < 1e-6): siblings
    listed in token order instead of draw order, depth-2 nodes given their parent's q, q raised to
    the power 1.5 or 0.7, and the with/without-replacement rules swapped (one case)."""
    params = SamplingParams(do_sample=True, temperature=temperature)
    draft = make_draft(dist_target, "edd", torch.arange(DIST_VOCAB)[-head:])
    prop = proposer(draft, StaticPolicy(tuple(k_config_tree((2, 2)))), children)
    decoder = Decoder(ModelRunner(dist_target), proposer=prop)
    counts: Counter = Counter()
    reached, accepted = [0, 0], [0, 0]
    for seed in range(DIST_CALLS):
        config = DecodeConfig(max_new_tokens=DIST_NEW, sampling=params, method="sd", num_draft_tokens=2, seed=seed)
        for r in decoder.generate([DIST_PROMPT] * DIST_STREAMS, config):
            assert len(r.token_ids) == DIST_NEW
            counts[tuple(r.token_ids[:JOINT])] += 1
            for depth in range(len(r.stats.reached_by_position)):
                reached[depth] += r.stats.reached_by_position[depth]
                accepted[depth] += r.stats.accepted_by_position[depth]
    assert all(0 < a < n for a, n in zip(accepted, reached))  # accepted and rejected drafts at both depths
    exact = exact_joint(dist_target, DIST_PROMPT, JOINT, params)
    assert chi_square_pvalue(counts, exact) > 1e-3
    for pair in (slice(0, 2), slice(1, 3)):
        assert chi_square_pvalue(marginal(counts, pair), marginal(exact, pair)) > 1e-3


def test_adaptive_fans_keep_the_target_joint(dist_target) -> None:
    """Temperature 1 with the adaptive length choosing chain length and fan width from the outcomes so far
    (top-ranked candidates, verified against the target's own draws): the joint of (x1, x2, x3) and its
    neighbouring pairs match the exact table."""
    params = SamplingParams(do_sample=True, temperature=1.0)
    draft = make_draft(dist_target, "edd", torch.arange(DIST_VOCAB))
    length = fanning_length()
    decoder = Decoder(ModelRunner(dist_target), proposer=proposer(draft), draft_length=length)
    counts: Counter = Counter()
    for seed in range(DIST_CALLS):
        config = DecodeConfig(max_new_tokens=DIST_NEW, sampling=params, method="sd", num_draft_tokens=2, seed=seed)
        for r in decoder.generate([DIST_PROMPT] * DIST_STREAMS, config):
            counts[tuple(r.token_ids[:JOINT])] += 1
    (ranks,) = length.runners_up.values()
    assert ranks.reached[0] > 0 and 0 < ranks.accepted[0] < ranks.reached[0]  # fans verified, some landed
    exact = exact_joint(dist_target, DIST_PROMPT, JOINT, params)
    assert chi_square_pvalue(counts, exact) > 1e-3
    for pair in (slice(0, 2), slice(1, 3)):
        assert chi_square_pvalue(marginal(counts, pair), marginal(exact, pair)) > 1e-3


def test_sampled_tree_drafts_carry_their_draft_distribution(dist_target) -> None:
    head = torch.arange(DIST_VOCAB)[-5:]
    draft = make_draft(dist_target, "edd", head)
    params = SamplingParams(do_sample=True)
    tokens = torch.tensor(DIST_PROMPT)
    with torch.no_grad():
        hidden = dist_target(tokens[None].to(dist_target.device), output_hidden_states=True).hidden_states[
            HIDDEN_LAYER
        ][0]
    for children in ("without_replacement", "with_replacement"):
        prop = proposer(draft, StaticPolicy(tuple(k_config_tree((3, 2)))), children)
        gen = torch.Generator().manual_seed(0)
        (d,) = prop.propose([DraftRequest(0, tokens, 2, hidden[:-1])], params, gen)
        assert d.rule == children
        assert d.parents.tolist() == [-1, -1, -1, 0, 0, 1, 1, 2, 2]
        assert d.q.shape == (9, DIST_VOCAB)
        torch.testing.assert_close(d.q.sum(-1), torch.ones(9))
        assert (d.q[:, : DIST_VOCAB - 5] == 0).all()  # no mass outside the head
        assert set(d.tokens.tolist()) <= set(head.tolist())
        assert d.q[:3].equal(d.q[:1].expand(3, -1))  # siblings share the distribution they were drawn from
        assert all(float(d.q[i, d.tokens[i]]) > 0 for i in range(9))
        if children == "without_replacement":
            for parent in (-1, 0, 1, 2):
                siblings = d.tokens[d.parents == parent].tolist()
                assert len(set(siblings)) == len(siblings)


def test_greedy_top_k_siblings_are_the_drafts_best_tokens(dist_target) -> None:
    """Under greedy decoding siblings are the draft's k most probable tokens, in order, and their
    confidences are the draft's softmax probabilities (not the one-hot greedy distribution)."""
    draft = make_draft(dist_target, "edd", torch.arange(DIST_VOCAB))
    tokens = torch.tensor(DIST_PROMPT)
    with torch.no_grad():
        hidden = dist_target(tokens[None].to(dist_target.device), output_hidden_states=True).hidden_states[
            HIDDEN_LAYER
        ][0]
    prop = proposer(draft, StaticPolicy(tuple(k_config_tree((3,)))), "top")
    (d,) = prop.propose([DraftRequest(0, tokens, 1, hidden[:-1])], SamplingParams(), None)
    runner = ModelRunner(draft.model)
    stream = runner.new_stream()
    embeds = torch.cat([draft.hidden_proj(hidden[:-1]), draft.model.get_input_embeddings()(tokens[-1:])]).detach()
    out = runner.forward([StreamTree(stream, TokenTree.chain(tokens), embeds)], last_only=True)
    best = out.logits[0][0].softmax(-1).topk(3)
    assert d.tokens.tolist() == draft.head_ids[best.indices].tolist()
    torch.testing.assert_close(d.confidence, best.values)
    assert float(d.confidence.max()) < 1.0


@pytest.mark.parametrize("kind", ["edd", "edd+next"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=1.0)])
def test_edd_drafts_from_cached_hidden_states_as_after_a_full_prefill(target, sampling, kind) -> None:
    """A search's child prompt extends its parent's sequence. Under an EDD draft the prefix cache hands
    back the reused prefix's KV *and* its hidden states, and the draft's own prefix cache its KV, so the
    draft proposes what it would after a full prefill: the same tokens, accepted drafts and draft
    confidences (fp32). The draft's hidden
    projection is randomised so that wrong or misplaced hidden states show (an untrained draft
    barely reads them: reversing the cached rows moved its confidences by only 2e-5). Under W_n (edd+next)
    a row holds its successor's embedding, so the sibling prompt that leaves a cached sequence one token early
    must not reuse that sequence's last row."""
    edd = make_draft(target, kind, HEAD_IDS)
    with torch.no_grad():
        weight = edd.hidden_proj.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    prompt0 = [3, 17, 42, 8, 21, 9, 60, 2, 2, 14, 33, 7, 50, 11, 38, 5, 19, 23]  # above MIN_SHARED_PREFIX
    config = DecodeConfig(method="sd", max_new_tokens=24, sampling=sampling, num_draft_tokens=3)

    def search(cache_tokens: int) -> tuple[list, list, torch.Tensor, int, int]:
        prop = proposer(edd, prefix_tokens=cache_tokens)
        decoder = Decoder(ModelRunner(target), proposer=prop, prefix_cache_tokens=cache_tokens)
        outputs, accepted, confidence, prefilled, prompt = [], [], [], 0, prompt0
        for depth in range(3):
            with decoder.session([prompt, prompt[:-1] + [44]], config, [depth, depth + 100]) as session:
                session.prefill(session.streams)
                while active := [s for s in session.streams if s.finish is None]:
                    session.verify(active, session.propose(active))
                prefilled += session.prefilled_tokens
            results = session.results()
            outputs += [r.token_ids for r in results]
            accepted += [r.stats.accepted_by_position for r in results]
            confidence += [r.stats.calibration_confidence for r in results]
            prompt = prompt + results[0].token_ids + [4, 6]  # the child's prompt extends its parent
        hits = min(decoder.prefix_cache.hits, prop.prefixes.hits)
        return outputs, accepted, torch.tensor(confidence), hits, prefilled

    plain, plain_accepted, plain_confidence, no_hits, prefilled_plain = search(0)
    cached, cached_accepted, cached_confidence, hits, prefilled = search(4096)
    assert no_hits == 0 and hits >= 2
    assert prefilled < prefilled_plain / 2
    assert sum(map(sum, plain_accepted)) > 0  # the drafts are tested, not just empty
    assert (cached, cached_accepted) == (plain, plain_accepted)
    assert torch.allclose(cached_confidence, plain_confidence, rtol=0, atol=1e-6)


def test_a_next_token_draft_remakes_the_last_row_it_reuses(target) -> None:
    """Under W_n a draft row holds its successor's embedding: a prompt that leaves a cached sequence after 18
    tokens must not reuse that sequence's 18th row, made for its 19th token (the confidences moved by 1e-3)."""
    edd = make_draft(target, "edd+next", HEAD_IDS)
    first = [3, 17, 42, 8, 21, 9, 60, 2, 2, 14, 33, 7, 50, 11, 38, 5, 19, 23, 30, 31, 32, 33]
    second = first[:18] + [44, 45, 46, 47, 48, 49]  # past the draft cache's 16-token minimum match
    config = DecodeConfig(method="sd", max_new_tokens=12, num_draft_tokens=3)

    def run(cache_tokens: int):
        prop = proposer(edd, prefix_tokens=cache_tokens)
        decoder = Decoder(ModelRunner(target), proposer=prop, prefix_cache_tokens=cache_tokens)
        decoder.generate([first], config)
        result = decoder.generate([second], config)[0]
        return result.token_ids, torch.tensor(result.stats.calibration_confidence), prop.prefixes.hits

    plain, cached = run(0), run(4096)
    assert cached[2] >= 1 and plain[2] == 0
    assert cached[0] == plain[0]
    assert torch.allclose(cached[1], plain[1], rtol=0, atol=1e-6)


def test_graft_into_shares_agreeing_nodes_and_scores_both_branches() -> None:
    """The docstring's example: root -> x (p 0.8) -> y (p 0.6), branch [x, z], a = 0.5 -> z new, f = [1, .8, .48, .4]."""
    from spectot.spec.proposers.draft_decoder import _Block, _graft_into

    block = _Block([7, 11, 12], parents=[-1, 0, 1], conf=[1.0, 0.8, 0.48], prob=[1.0, 0.8, 0.6], q=[None] * 3)
    conf = _graft_into(block, [11, 13], 0.5)
    assert block.tokens == [7, 11, 12, 13] and block.parents == [-1, 0, 1, 1]
    assert conf == pytest.approx([1.0, 0.8, 0.48, 0.4])
    assert math.isnan(block.prob[3]) and block.q[3] is None
    # a branch the draft did not foresee at all: its first node hangs from the root at f = a; a shared node's
    # f is raised to a where the draft was less sure, and its draft children inherit the raise
    block = _Block([7, 11, 12], parents=[-1, 0, 1], conf=[1.0, 0.2, 0.1], prob=[1.0, 0.2, 0.5], q=[None] * 3)
    assert _graft_into(block, [11], 0.5) == pytest.approx([1.0, 0.5, 0.25])
    assert _graft_into(block, [9, 9], 0.5)[-2:] == pytest.approx([0.5, 0.25])


@pytest.mark.parametrize("kind", ["edd", "vdm"])
def test_sized_pct_selects_the_lookup_branch_with_the_drafts_nodes(target, drafts, kind: str) -> None:
    """PCT sized by t(n) picks among the draft's and the grafted nodes together: on free rows both are verified,
    on rows that cost a full step each (t(n) = n) no node pays, grafted ones included; greedy stays AR."""
    ar = [r.token_ids for r in decode(target, REPEATING, max_new_tokens=MAX_NEW)]
    config = {"max_new_tokens": MAX_NEW, "num_draft_tokens": 5}
    proposed = {}
    for name, cost in {"free": lambda n: 1.0, "linear": lambda n: float(n)}.items():
        for lookup in (0, 1):
            prop = proposer(drafts[kind], PCTPolicy(threshold=0.05, verify_cost=cost))
            prop.lookup = lookup
            out = decode(target, REPEATING, prop, **config)
            assert [r.token_ids for r in out] == ar
            steps = sum(r.stats.verify_steps for r in out)
            proposed[name, lookup] = sum(r.stats.proposed for r in out) / steps  # nodes verified a step
    assert proposed["free", 1] > proposed["free", 0] > 0
    assert proposed["linear", 0] == proposed["linear", 1] == 0


def test_a_tree_of_the_root_alone_drafts_nothing(target) -> None:
    """Sequoia's sizing picks n = 1 (plain decoding) for a large batch; its one-node tree must draft nothing (the
    native chain was asked for zero depths and raised, failing a continuous engine's whole step)."""
    prop = proposer(make_draft(target, "edd", HEAD_IDS), policy=StaticPolicy((-1,)))
    want = decode(target, [[3, 17, 42, 8]], max_new_tokens=8)[0].token_ids
    got = decode(target, [[3, 17, 42, 8]], prop, max_new_tokens=8, num_draft_tokens=3)[0]
    assert got.token_ids == want and got.stats.proposed == 0 and prop.forwards == 0


def test_a_stream_that_drafts_nothing_for_a_while_keeps_its_hidden_states(target) -> None:
    """Steps whose tree is the root alone read no hidden states; the rows they brought wait for the next catch-up
    (they were dropped: 'EDD needs the target's hidden states of 484 new tokens, got 1', continuous-sd on SmolLM2)."""
    prop = proposer(make_draft(target, "edd", HEAD_IDS))
    decoder = Decoder(ModelRunner(target), proposer=prop)
    prompt = [3, 17, 42, 8, 21, 9]
    want = decode(target, [prompt], max_new_tokens=16)[0].token_ids
    root, chain = StaticPolicy((-1,)), StaticPolicy((-1, 0, 1))
    config = DecodeConfig(method="sd", max_new_tokens=16, num_draft_tokens=2)
    with decoder.session([prompt], config) as session:
        session.prefill(session.streams)
        step = 0
        while active := [s for s in session.streams if s.finish is None]:
            session.verify(active, session.propose(active, chain if step % 3 == 2 else root))
            step += 1
        got = session.results()[0]
    assert got.token_ids == want and got.stats.proposed > 0


def test_sampled_siblings_are_refused_under_a_policy_that_prunes_them(dist_target) -> None:
    """PCT, CaPE and EAGLE-2 keep or drop siblings by their own draft probability: sampled siblings kept that way are
    no longer the draws from q verification assumes (CaPE slipped through the CLI guard; a tree handed out per
    request slipped past any)."""
    draft = make_draft(dist_target, "edd", torch.arange(DIST_VOCAB))
    for policy in (PCTPolicy(threshold=0.1), CAPEPolicy(max_depth=9), EAGLE2Policy()):
        for children in ("with_replacement", "without_replacement"):
            with pytest.raises(ValueError, match="sampled siblings"):
                proposer(draft, policy, children)
    prop = proposer(draft, StaticPolicy(tuple(k_config_tree((2, 2)))), "without_replacement")
    tokens = torch.tensor(DIST_PROMPT)
    with torch.no_grad():
        states = dist_target(tokens[None].to(dist_target.device), output_hidden_states=True).hidden_states
    request = DraftRequest(0, tokens, 2, states[HIDDEN_LAYER][0][:-1], policy=CAPEPolicy())
    with pytest.raises(ValueError, match="CAPEPolicy keeps or drops siblings"):
        prop.propose([request], SamplingParams(do_sample=True), torch.Generator().manual_seed(0))
    prop.propose([request], SamplingParams(), None)  # greedy: top children, nothing sampled


def test_a_failed_steps_draft_kv_is_not_kept(target, drafts) -> None:
    """A session closed after an error freed its target KV but gave its streams' draft KV to the draft's prefix
    cache, for later prompts to fork."""
    prop = proposer(drafts["edd"])
    decoder = Decoder(ModelRunner(target), proposer=prop)
    prompt = [3 + i % 50 for i in range(40)]
    with decoder.session([prompt], DecodeConfig(method="sd", max_new_tokens=8)) as session:
        session.prefill(session.streams)
        session.propose(session.streams)  # the draft has prompt KV now
        assert prop._streams
        session.close(keep=False)
    assert len(prop.prefixes) == 0 and prop.runner.cache.used == 0
    decoder.generate([prompt], DecodeConfig(method="sd", max_new_tokens=8))  # a step that ends well keeps it
    assert len(prop.prefixes) == 1


def test_a_tree_wider_than_the_draft_head_is_refused_by_name(target) -> None:
    """--draft-head 2 under a k_config (3, 1) tree drafted into an IndexError (the tree asked for ranks the head
    does not hold); a policy handed per request (a tree budget's) is checked too."""
    narrow = make_draft(target, "vdm", torch.tensor([5, 7]))
    wide = StaticPolicy(tuple(k_config_tree((3, 1))))
    with pytest.raises(ValueError, match="3 children per node but the draft head holds 2 tokens: raise --draft-head"):
        proposer(narrow, wide)
    prop = proposer(narrow)
    request = DraftRequest(0, torch.tensor([3, 17, 42]), 2, policy=wide)
    with pytest.raises(ValueError, match="raise --draft-head"):
        prop.propose([request], SamplingParams(), None)
    with pytest.raises(ValueError, match="children must be one of top, without_replacement"):
        proposer(narrow, children="bogus")


def test_a_nan_pct_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="threshold"):
        PCTPolicy(threshold=float("nan"))


def test_pct_prices_its_tree_for_every_stream_of_the_forward(drafts) -> None:
    """The decoder drafts each sampling group in its own call, and PCT priced the tree for that group's streams
    only: with 4 greedy and 4 sampled streams sharing a forward, each tree was sized by t(4 n) / t(4), too big
    where rows are not free. ``DraftRequest.streams`` now names the forward's streams."""
    from spectot.spec.trees.sizing import TCurve

    steep = TCurve(((1, 1.0), (4, 1.05), (8, 2.0), (64, 40.0)))  # 4 rows nearly free, then each costs
    policy = PCTPolicy(threshold=0.0, width=2, max_depth=4, max_nodes=16, verify_cost=steep)
    tokens = torch.tensor([3, 17, 42])

    def nodes(streams: int) -> int:
        prop = proposer(drafts["vdm"], policy)
        requests = [DraftRequest(i, tokens, 4, streams=streams) for i in range(2)]
        return sum(d.tokens.numel() for d in prop.propose(requests, SamplingParams(), None))

    alone, shared = nodes(0), nodes(8)  # priced for the call's 2 streams, then for the forward's 8
    assert shared < alone, (shared, alone)
