"""ModelRunner: tree forwards over the flat KV cache equal plain transformers forwards.

Reference: the checkpoint's own HF forward over each node's root-to-node path,
``model(input_ids).logits[0, -1]``, and HF's ``past_key_values`` after prefilling a stream's
accepted tokens.
"""

from __future__ import annotations

import copy

import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from spectot.engine.runner import ContextOverflowError, ModelRunner, StreamTree, TiledMatmul
from spectot.engine.token_tree import TokenTree
from spectot.models.loader import ModelLoadError

FAMILY_SEEDS = {"llama": 0, "qwen2": 1, "mistral": 2, "qwen3": 3}
VOCAB = 64
LOGIT_TOL = 1e-4
KV_TOL = 1e-5


@pytest.fixture(params=list(FAMILY_SEEDS))
def model(request, tiny_model):
    return tiny_model(request.param, FAMILY_SEEDS[request.param])


@pytest.fixture(params=[True, False], ids=["native", "batched"])
def native(request) -> bool:
    """Attention in spectot's CPU kernel, or the batched float64 path a GPU runs."""
    return request.param


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_tree(n: int, seed: int) -> TokenTree:
    """n nodes, each hung under a random earlier node."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return TokenTree(torch.randint(0, VOCAB, (n,), generator=g), torch.tensor(parents))


# 7 nodes, depth 3:      0
#                      /   \
#                     1     2
#                    / \     \
#                   3   4     5
#                   |
#                   6
FIXED_TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def fixed_tree(seed: int) -> TokenTree:
    return TokenTree(torch.tensor(random_tokens(7, seed)), torch.tensor(FIXED_TREE_PARENTS))


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """(V,) logits of the next token after ids."""
    return model(torch.tensor([ids], device=model.device)).logits[0, -1].cpu()  # the runner's logits are host ones


@torch.no_grad()
def hf_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each (H_kv, T, D), after prefilling ids."""
    cache = model(torch.tensor([ids], device=model.device), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def path_ids(tree: TokenTree, node: int) -> list[int]:
    return tree.tokens[tree.path_to(node)].tolist()


def prefill(runner: ModelRunner, ids: list[int], fork_of: int | None = None) -> int:
    sid = runner.new_stream(fork_of)
    runner.forward([StreamTree(sid, TokenTree.chain(ids))])
    runner.commit_all()
    return sid


def assert_tree_logits_match(model, prefix: list[int], tree: TokenTree, logits: torch.Tensor) -> None:
    assert logits.shape == (len(tree), VOCAB)
    assert logits.dtype == torch.float32
    for node in range(len(tree)):
        expected = hf_logits(model, prefix + path_ids(tree, node))
        diff = (logits[node] - expected).abs().max().item()
        assert diff < LOGIT_TOL, f"node {node}: max abs diff {diff}"


def assert_stream_kv_matches(runner: ModelRunner, model, sid: int, ids: list[int]) -> None:
    slots = runner.cache.slots(sid)
    assert slots.numel() == len(ids)
    for layer, (keys, values) in enumerate(hf_kv(model, ids)):
        layer_keys, layer_values = runner.cache.keys_values(layer)
        ours_k, ours_v = layer_keys[:, slots], layer_values[:, slots]
        assert ours_k.shape == keys.shape
        assert (ours_k - keys).abs().max().item() < KV_TOL, f"layer {layer} keys"
        assert (ours_v - values).abs().max().item() < KV_TOL, f"layer {layer} values"


# -- logits --------------------------------------------------------------------------------


def test_prefill_logits_match_hf_at_every_position(model, native: bool) -> None:
    ids = random_tokens(9, seed=10)
    runner = ModelRunner(model, native_attention=native)
    sid = runner.new_stream()
    out = runner.forward([StreamTree(sid, TokenTree.chain(ids))])
    with torch.no_grad():
        expected = model(torch.tensor([ids], device=model.device)).logits[0].cpu()
    assert out.hidden is None
    assert len(out.logits) == 1
    assert (out.logits[0] - expected).abs().max().item() < LOGIT_TOL


@pytest.mark.parametrize("tree_seed", [0, 1])
def test_tree_logits_match_hf_on_each_root_to_node_path(model, tree_seed: int, native: bool) -> None:
    prefix = random_tokens(6, seed=20 + tree_seed)
    tree = fixed_tree(seed=30 + tree_seed)
    assert int(tree.depths.max()) == 3
    runner = ModelRunner(model, native_attention=native)
    sid = prefill(runner, prefix)
    out = runner.forward([StreamTree(sid, tree)])
    assert_tree_logits_match(model, prefix, tree, out.logits[0])


@pytest.mark.parametrize("tree_seed", [2, 3, 4])
def test_random_topology_tree_logits_match_hf(tiny_llama, tree_seed: int, native: bool) -> None:
    model = tiny_llama(0)
    prefix = random_tokens(4, seed=40 + tree_seed)
    tree = random_tree(7, seed=tree_seed)
    runner = ModelRunner(model, native_attention=native)
    sid = prefill(runner, prefix)
    out = runner.forward([StreamTree(sid, tree)])
    assert_tree_logits_match(model, prefix, tree, out.logits[0])


@pytest.mark.parametrize("rows", [1, 4])
def test_the_drafts_fused_attention_path_matches_hf(tiny_llama, rows: int) -> None:
    """A draft's runner off the native kernel (a GPU) attends with torch's SDPA: one-row steps (no mask
    at all) and chains (a causal mask) still give transformers' logits, and two streams of different
    lengths in one forward (padded columns) each their own."""
    model = tiny_llama(0)
    runner = ModelRunner(model, exact_attention=False, native_attention=False)
    prefixes = [random_tokens(5, seed=70), random_tokens(8, seed=71)]
    streams = [prefill(runner, ids) for ids in prefixes]
    steps = [TokenTree.chain(random_tokens(rows, seed=72 + i)) for i in range(2)]
    alone = runner.forward([StreamTree(streams[0], steps[0])])
    runner.commit({})
    assert_tree_logits_match(model, prefixes[0], steps[0], alone.logits[0])
    both = runner.forward([StreamTree(sid, tree) for sid, tree in zip(streams, steps)])
    runner.commit({})
    for ids, tree, logits in zip(prefixes, steps, both.logits):
        assert_tree_logits_match(model, ids, tree, logits)


@pytest.mark.parametrize("n", [0, 1, 5, 64, 70, 130])
def test_tiled_matmul_is_torchs_linear_row_for_row(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    weight, bias = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(1, n, 16, generator=gen)
    tiled = TiledMatmul()
    w = tiled.prepare(weight, bias)
    out = tiled(x, w)
    assert out.shape == (1, n, 24)
    rows = [torch.nn.functional.linear(x[0, i : i + 1], weight, bias)[0] for i in range(n)]
    torch.testing.assert_close(out[0], torch.stack(rows) if rows else out.new_zeros(0, 24), rtol=1e-6, atol=1e-5)


def test_tiled_bf16_tree_rows_equal_the_ar_steps_bit_for_bit(tiny_llama) -> None:
    """--kernels tiled on the batched path (a GPU's): a 5-token chain verified in one forward gives each
    row the very bf16 logits its one-row AR step gives (run with SPECTOT_TEST_DEVICE=cuda, this is the
    GPU check; the CPU's torch bf16 matmul happens to be batch-invariant already)."""
    model = copy.deepcopy(tiny_llama(0)).to(torch.bfloat16)
    runner = ModelRunner(model, kernels="tiled", native_attention=False)
    prefix, chain = random_tokens(6, seed=80), random_tokens(5, seed=81)
    sid = prefill(runner, prefix)
    together = runner.forward([StreamTree(sid, TokenTree.chain(chain))]).logits[0]
    runner.commit({})
    for i, token in enumerate(chain):
        step = runner.forward([StreamTree(sid, TokenTree.chain([token]))]).logits[0]
        runner.commit_all()
        assert torch.equal(step[0], together[i]), f"row {i}"


def test_tiled_fp32_tree_rows_equal_the_ar_steps_bit_for_bit(tiny_llama) -> None:
    """fp32 on torch's matmul rounds a row by how many rows share the forward (MKL: 1, 2-3, 4+ rows differ by
    ~1e-7, so a near-tie can part sd from ar); --kernels tiled gives every linear one shape, and rows equal."""
    runner = ModelRunner(tiny_llama(0), kernels="tiled")
    plain = ModelRunner(tiny_llama(0), kernels="torch")
    prefix, chain = random_tokens(6, seed=82), random_tokens(5, seed=83)
    rows_differ = []
    for r in (runner, plain):
        sid = prefill(r, prefix)
        together = r.forward([StreamTree(sid, TokenTree.chain(chain))]).logits[0]
        r.commit({})
        steps = []
        for token in chain:
            steps.append(r.forward([StreamTree(sid, TokenTree.chain([token]))]).logits[0][0])
            r.commit_all()
        rows_differ.append([i for i, step in enumerate(steps) if not torch.equal(step, together[i])])
    assert rows_differ[0] == [], rows_differ  # (torch's differ here: MKL's GEMV and GEMM)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(steps, together))  # torch's: equal to rounding


def build_three_streams(runner: ModelRunner) -> dict[str, tuple[int, list[int]]]:
    """A: 5 tokens; B: 8 other tokens; C: a fork of A with 2 more tokens (shares A's 5 slots)."""
    a_ids, b_ids, c_extra = random_tokens(5, seed=50), random_tokens(8, seed=51), random_tokens(2, seed=52)
    a = prefill(runner, a_ids)
    b = prefill(runner, b_ids)
    c = runner.new_stream(fork_of=a)
    runner.forward([StreamTree(c, TokenTree.chain(c_extra))])
    runner.commit_all()
    return {"A": (a, a_ids), "B": (b, b_ids), "C": (c, a_ids + c_extra)}


def test_several_streams_in_one_forward_match_each_alone(model, native: bool) -> None:
    runner = ModelRunner(model, native_attention=native)
    streams = build_three_streams(runner)
    assert runner.cache.used == 5 + 8 + 2  # C's prefix is A's slots, not a copy
    trees = {"A": fixed_tree(seed=60), "B": TokenTree.chain(random_tokens(3, seed=61)), "C": random_tree(5, seed=62)}
    out = runner.forward([StreamTree(streams[name][0], trees[name]) for name in ("A", "B", "C")])
    for name, logits in zip(("A", "B", "C"), out.logits):
        assert_tree_logits_match(model, streams[name][1], trees[name], logits)


def test_last_only_returns_each_trees_last_node(tiny_llama) -> None:
    model = tiny_llama(0)
    runner = ModelRunner(model)
    streams = build_three_streams(runner)
    chains = {name: random_tokens(n, seed=70 + n) for name, n in (("A", 1), ("B", 3), ("C", 2))}
    out = runner.forward(
        [StreamTree(streams[name][0], TokenTree.chain(chains[name])) for name in ("A", "B", "C")], last_only=True
    )
    for name, logits in zip(("A", "B", "C"), out.logits):
        assert logits.shape == (1, VOCAB)
        expected = hf_logits(model, streams[name][1] + chains[name])
        assert (logits[0] - expected).abs().max().item() < LOGIT_TOL


# -- commit ----------------------------------------------------------------------------------


def test_commit_leaves_the_cache_hf_would_prefill(model, native: bool) -> None:
    runner = ModelRunner(model, native_attention=native)
    streams = build_three_streams(runner)
    before = {name: runner.length(sid) for name, (sid, _) in streams.items()}
    trees = {"A": fixed_tree(seed=80), "B": TokenTree.chain(random_tokens(3, seed=81)), "C": random_tree(5, seed=82)}
    runner.forward([StreamTree(streams[name][0], trees[name]) for name in ("A", "B", "C")])
    accepted_nodes = {"A": trees["A"].path_to(6), "B": [0]}  # C keeps nothing: a rollback
    runner.commit({streams[name][0]: nodes for name, nodes in accepted_nodes.items()})

    expected_ids = {
        "A": streams["A"][1] + path_ids(trees["A"], 6),
        "B": streams["B"][1] + path_ids(trees["B"], 0),
        "C": streams["C"][1],
    }
    for name, (sid, _) in streams.items():
        assert runner.length(sid) == len(expected_ids[name])
        assert_stream_kv_matches(runner, model, sid, expected_ids[name])
    assert runner.length(streams["C"][0]) == before["C"]
    # every rejected node is gone: the buffer holds exactly the slots some stream holds
    held = torch.cat([runner.cache.slots(sid) for sid, _ in streams.values()]).unique()
    assert held.tolist() == list(range(runner.cache.used))

    # and the next forward continues from the committed state
    nxt = {name: random_tokens(2, seed=90 + i) for i, name in enumerate(("A", "B", "C"))}
    out = runner.forward([StreamTree(streams[name][0], TokenTree.chain(nxt[name])) for name in ("A", "B", "C")])
    for name, logits in zip(("A", "B", "C"), out.logits):
        assert_tree_logits_match(model, expected_ids[name], TokenTree.chain(nxt[name]), logits)


def test_commit_all_keeps_every_chain_token(tiny_llama) -> None:
    model = tiny_llama(0)
    runner = ModelRunner(model)
    ids = random_tokens(7, seed=100)
    sid = prefill(runner, ids[:4])
    runner.forward([StreamTree(sid, TokenTree.chain(ids[4:]))])
    runner.commit_all()
    assert_stream_kv_matches(runner, model, sid, ids)


def test_truncate_rolls_back_and_release_frees(tiny_llama) -> None:
    model = tiny_llama(0)
    runner = ModelRunner(model)
    ids = random_tokens(8, seed=110)
    other = random_tokens(3, seed=111)
    sid = prefill(runner, ids)
    runner.truncate(sid, 5)
    assert runner.length(sid) == 5
    assert runner.cache.used == 5
    out = runner.forward([StreamTree(sid, TokenTree.chain(other))])
    assert_tree_logits_match(model, ids[:5], TokenTree.chain(other), out.logits[0])
    runner.commit_all()
    assert_stream_kv_matches(runner, model, sid, ids[:5] + other)
    runner.release(sid)
    assert runner.cache.used == 0


# -- hidden states -----------------------------------------------------------------------------


@pytest.mark.parametrize("hidden_layer", [0, 1, 2, -1, -2])
def test_hidden_layer_matches_hf_hidden_states(model, hidden_layer: int, native: bool) -> None:
    # transformers' hidden_states: 0 = embeddings, 1 = layer 1's output, 2 (the last) = after the final norm
    prefix = random_tokens(4, seed=120)
    tree = fixed_tree(seed=121)
    runner = ModelRunner(model, native_attention=native)
    sid = prefill(runner, prefix)
    out = runner.forward([StreamTree(sid, tree)], hidden_layer=hidden_layer)
    assert out.hidden is not None
    hidden = out.hidden[0]
    assert hidden.shape == (len(tree), model.config.hidden_size)
    for node in range(len(tree)):
        with torch.no_grad():
            ids = torch.tensor([prefix + path_ids(tree, node)], device=model.device)
            states = model(ids, output_hidden_states=True).hidden_states
        assert len(states) == 3
        assert (hidden[node] - states[hidden_layer][0, -1]).abs().max().item() < LOGIT_TOL


# -- limits and misuse -------------------------------------------------------------------------


def test_context_overflow(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(0), max_context=8)
    assert runner.max_context == 8
    sid = prefill(runner, random_tokens(6, seed=140))
    deep = TokenTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 0]))  # depth 3: 6 + 3 > 8
    with pytest.raises(ContextOverflowError, match="context is 8"):
        runner.forward([StreamTree(sid, deep)])
    # the refused forward left nothing pending, and a tree that fits still runs
    wide = TokenTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, 0]))  # depth 2: 6 + 2 == 8
    out = runner.forward([StreamTree(sid, wide)])
    assert out.logits[0].shape == (4, VOCAB)
    runner.commit({sid: [0, 3]})
    assert runner.length(sid) == 8


def test_max_context_is_capped_by_the_model(tiny_llama, tiny_mistral) -> None:
    assert ModelRunner(tiny_llama(0)).max_context == tiny_llama(0).config.max_position_embeddings
    assert ModelRunner(tiny_llama(0), max_context=10**9).max_context == tiny_llama(0).config.max_position_embeddings
    windowed = tiny_mistral(2, sliding_window=16)
    assert ModelRunner(windowed).max_context == 16
    assert ModelRunner(windowed, max_context=100).max_context == 16


def test_forward_twice_without_commit_raises(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(0))
    sid = runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain([1, 2]))])
    with pytest.raises(RuntimeError, match="commit"):
        runner.forward([StreamTree(sid, TokenTree.chain([3]))])


def test_freeing_slots_while_a_forward_is_pending_raises(tiny_llama) -> None:
    """A release or truncate between forward and commit shifted the pending slots down, and the commit then kept
    slots past the cache's end (another stream's KV, in silence)."""
    runner = ModelRunner(tiny_llama(0))
    b, a = runner.new_stream(), runner.new_stream()
    for sid, tokens in ((b, [4, 5, 6, 7]), (a, [8, 9, 10, 11, 12])):
        runner.forward([StreamTree(sid, TokenTree.chain(tokens))])
        runner.commit_all()
    runner.forward([StreamTree(a, TokenTree.chain([13, 14, 15]))])
    for free in (lambda: runner.release(b), lambda: runner.truncate(b, 1)):
        with pytest.raises(RuntimeError, match="while a forward is pending: commit"):
            free()
    runner.commit_all()
    runner.release(b)  # once committed, fine
    assert runner.length(a) == 8


def test_an_error_after_the_forward_leaves_nothing_pending(tiny_llama, monkeypatch) -> None:
    """The host copy of the logits is where a device error or a Ctrl-C surfaces: raised after the forward was
    marked pending, every cleanup's release then failed ('release() while a forward is pending'), hiding it."""
    import spectot.engine.runner as runner_module

    runner = ModelRunner(tiny_llama(0))
    a, b = runner.new_stream(), runner.new_stream()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner_module, "ForwardOutput", interrupted)
    trees = [StreamTree(a, TokenTree.chain([1, 2, 3])), StreamTree(b, TokenTree.chain([4, 5]))]
    with pytest.raises(KeyboardInterrupt):
        runner.forward(trees)
    runner.release(a)  # cleanup works: nothing pending, no slot held
    assert runner.length(b) == 0 and runner.cache.used == 0


def test_rows_and_embeddings_must_fit_their_tree(tiny_llama) -> None:
    """A logit row past its tree (or negative) read a neighbouring stream's logits; embeddings of the wrong row
    count were split at the wrong boundaries."""
    runner = ModelRunner(tiny_llama(0))
    a, b = runner.new_stream(), runner.new_stream()
    trees = [StreamTree(a, TokenTree.chain([1, 2, 3])), StreamTree(b, TokenTree.chain([4, 5]))]
    for rows in ([[3], [0]], [[0], [-1]]):
        with pytest.raises(ValueError, match="logit_rows of tree"):
            runner.forward(trees, logit_rows=rows)
    hidden = runner.model.config.hidden_size
    wrong = [StreamTree(a, TokenTree.chain([1, 2, 3]), torch.zeros(4, hidden)), trees[1]]
    with pytest.raises(ValueError, match="tree 0 has 3 nodes but 4 embedding rows"):
        runner.forward(wrong)
    assert runner.length(a) == runner.length(b) == 0  # nothing reserved


def test_commit_without_forward_raises(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(0))
    with pytest.raises(RuntimeError):
        runner.commit({})
    with pytest.raises(RuntimeError):
        runner.commit_all()


def test_commit_of_a_non_path_raises(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(0))
    sid = prefill(runner, [1, 2, 3])
    runner.forward([StreamTree(sid, fixed_tree(seed=150))])
    with pytest.raises(ValueError, match="root-to-node path"):
        runner.commit({sid: [0, 2, 3]})  # 3 hangs under 1, not 2


def test_commit_of_a_path_not_starting_at_the_root_raises(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(0))
    sid = prefill(runner, [1, 2, 3])
    runner.forward([StreamTree(sid, fixed_tree(seed=151))])
    with pytest.raises(ValueError, match="root-to-node path"):
        runner.commit({sid: [1, 3]})


def test_forward_needs_a_tree(tiny_llama) -> None:
    with pytest.raises(ValueError):
        ModelRunner(tiny_llama(0)).forward([])


def test_inconsistent_forward_arguments_are_refused_before_any_work(tiny_llama) -> None:
    """The same stream twice (both trees would sit at its length: the second's keys at the wrong positions, then
    appended), a logit_rows list per tree short, a hidden layer past the model's (it wrapped around), accepted
    nodes for a stream not in the forward (silently kept nothing): each refused, the cache as it was."""
    runner = ModelRunner(tiny_llama(0))
    sid, other = prefill(runner, [1, 2, 3]), prefill(runner, [4, 5])
    used = runner.cache.used
    chain = TokenTree.chain([6, 7])
    with pytest.raises(ValueError, match="twice"):
        runner.forward([StreamTree(sid, chain), StreamTree(sid, chain)])
    with pytest.raises(ValueError, match="one list per tree"):
        runner.forward([StreamTree(sid, chain), StreamTree(other, chain)], logit_rows=[[1]])
    with pytest.raises(ValueError, match="hidden_layer"):
        runner.forward([StreamTree(sid, chain)], hidden_layer=len(runner._layers) + 1)
    assert runner.cache.used == used
    runner.forward([StreamTree(sid, chain)])
    with pytest.raises(ValueError, match="not all in the forward"):
        runner.commit({other: [0]})
    runner.commit({sid: [0, 1]})  # the refused commit left the forward pending
    assert runner.cache.length(sid) == 5 and runner.cache.length(other) == 2


def test_one_row_returns_the_logit_rows_asked_for_on_every_path(tiny_llama) -> None:
    """A one-node tree took the native one-row path, which returned its row whatever ``logit_rows`` asked."""
    model = copy.deepcopy(tiny_llama(0)).to(torch.bfloat16)  # the fixture's model is shared
    for kernels in ("spectot", "torch"):
        runner = ModelRunner(model, kernels=kernels)
        sid = prefill(runner, [1, 2, 3])
        out = runner.forward([StreamTree(sid, TokenTree.chain([4]))], logit_rows=[[]])
        assert out.logits[0].shape[0] == 0
        runner.commit_all()


def test_draft_rows_refuses_bad_ancestors_without_holding_slots(tiny_llama) -> None:
    runner = ModelRunner(copy.deepcopy(tiny_llama(0)).to(torch.bfloat16), kernels="spectot")
    if not runner.drafts_natively:
        pytest.skip("the native layer loop did not build here")
    sid, scratch = prefill(runner, [1, 2, 3]), runner.new_stream()
    used = runner.cache.used
    with pytest.raises(ValueError, match="ancestor"):
        runner.draft_rows(sid, scratch, torch.tensor([4, 5]), [1, 2], [[], [3]], k=2)  # scratch holds no entry 3
    with pytest.raises(ValueError, match="one depth"):
        runner.draft_rows(sid, scratch, torch.tensor([4, 5]), [1], [[], []], k=2)
    assert runner.cache.used == used


def test_forward_past_the_cache_capacity_grows_it(tiny_llama) -> None:
    # Regression: growing the cache inside torch.inference_mode made its tensors inference
    # tensors, and the next in-place refcount update (commit, release) raised.
    model = tiny_llama(0)
    runner = ModelRunner(model, capacity=4)
    ids = random_tokens(7, seed=160)
    sid = runner.new_stream()
    out = runner.forward([StreamTree(sid, TokenTree.chain(ids))])
    runner.commit_all()
    assert runner.cache.capacity >= 7
    assert_tree_logits_match(model, [], TokenTree.chain(ids), out.logits[0])
    assert_stream_kv_matches(runner, model, sid, ids)
    tree = fixed_tree(seed=161)  # grows again, with rejected nodes to remove
    out = runner.forward([StreamTree(sid, tree)])
    runner.commit({sid: tree.path_to(5)})
    assert_tree_logits_match(model, ids, tree, out.logits[0])
    assert_stream_kv_matches(runner, model, sid, ids + path_ids(tree, 5))
    runner.release(sid)
    assert runner.cache.used == 0


# -- architectures -----------------------------------------------------------------------------


def test_unsupported_family_is_refused() -> None:
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(config).eval()
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        ModelRunner(gpt2)


def test_linear_attention_layers_are_refused(tiny_model) -> None:
    model = tiny_model("qwen2", 1)
    config = types.SimpleNamespace(**model.config.to_dict())
    config.layer_types = ["full_attention", "linear_attention"]
    hybrid = types.SimpleNamespace(config=config, model=model.model, get_output_embeddings=model.get_output_embeddings)
    with pytest.raises(ModelLoadError, match="linear-attention"):
        ModelRunner(hybrid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_equals_the_rotary_module(model, dtype: torch.dtype) -> None:
    """cos/sin come from a table grown on demand: the module's own values at any position, bit for bit, in
    the form the layers take (bf16 on this CPU: the fused op's; fp32: rotation_factors')."""
    runner = ModelRunner(copy.deepcopy(model).to(dtype))
    x = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype)
    for positions in ([0, 3, 3, 7], [300, 2], list(range(600, 610))):  # the second grows the table past 256
        index = torch.tensor(positions)
        cos, sin = runner._rope(x, index, max(positions) + 1)
        want_cos, want_sin = runner._rope_form(*runner._rotary(x, index[None]))
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
