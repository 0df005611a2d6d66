"""spectot's AVX2 kernels (bf16 linear, tree attention): accurate, and batch-invariant bit for bit
(the property that lets a tree forward reproduce the AR step exactly in bf16)."""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from spectot.engine.kernels import bf16_linear, tree_attention
from spectot.engine.runner import ContextOverflowError, ModelRunner, SpectotMatmul, StreamTree, pick_linear
from spectot.engine.token_tree import TokenTree
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.proposers.ngram import NgramProposer

module = bf16_linear()
pytestmark = pytest.mark.skipif(module is None, reason="needs an x86 CPU with AVX2 + FMA and a C++ toolchain")


def kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through the kernel's own layout (packed once, as the runner does)."""
    matmul = SpectotMatmul(module)
    return matmul(x, matmul.prepare(w, b))


@pytest.mark.parametrize("in_features", [64, 37, 8, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_reference_within_bf16_rounding(in_features: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(in_features)
    x = torch.randn(13, in_features, generator=gen).bfloat16()
    w = torch.randn(40, in_features, generator=gen).bfloat16()
    b = torch.randn(40, generator=gen).bfloat16() if with_bias else None
    y = kernel(x, w, b)
    ref = x.float() @ w.float().T + (b.float() if with_bias else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (13, 40)
    # one bf16 rounding of the output: relative error <= 2^-8, plus fp32 accumulation noise
    assert ((y.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-4).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 17, 33])
@pytest.mark.parametrize("in_features", [96, 577])  # 577: several chunks of a panel's features, the last one short
def test_every_row_is_computed_as_if_alone(rows: int, in_features: int) -> None:
    """Rows go in groups with tiles of their own shape, and past one group (5 rows on AVX2, 6 with AVX512-BF16)
    a panel is read in chunks whose sums wait in memory between the groups: a row's bits must still be the
    ones it gets alone (one uninterrupted pass)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(300, in_features, generator=gen).bfloat16()
    b = torch.randn(300, generator=gen).bfloat16()
    batched = kernel(x, w, b)
    alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(rows)])
    assert torch.equal(batched, alone)


def test_the_runner_keeps_every_forward_on_one_path() -> None:
    cpu = torch.device("cpu")
    assert pick_linear(torch.bfloat16, cpu, "auto").amx_rows == 1
    assert pick_linear(torch.bfloat16, cpu, "spectot").amx_rows == 1


def test_a_draft_runner_takes_the_lanes_for_one_row() -> None:
    cpu = torch.device("cpu")
    assert pick_linear(torch.bfloat16, cpu, "auto", batch_invariant=False).amx_rows == 2


@pytest.mark.skipif(module is None or not module.amx(), reason="needs a CPU with AMX (and the OS's leave to use it)")
def test_amx_tiles_agree_with_the_vdpbf16ps_path_to_one_bf16_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(19, 576, generator=gen).bfloat16()
    w = torch.randn(200, 576, generator=gen).bfloat16()
    b = torch.randn(200, generator=gen).bfloat16()
    packed = module.pack(w)
    tiles, lanes = module.linear(x, packed, b, 200, 1), module.linear(x, packed, b, 200, 10**9)
    step = lanes.float().abs() * 2**-7 + 1e-3  # at most one bf16 rounding apart
    assert ((tiles.float() - lanes.float()).abs() <= step).all()
    assert (tiles == lanes).float().mean() > 0.99
    # the tile path is batch-invariant on its own: 16-row blocks and a 3-row remainder alike
    alone = torch.cat([module.linear(x[i : i + 1], packed, b, 200, 1) for i in range(19)])
    assert torch.equal(tiles, alone)


def test_no_rows_give_an_empty_result() -> None:
    """A draft's catch-up can have no new entries: zero rows in, zero rows out (no tile runs)."""
    w = torch.randn(70, 64).bfloat16()
    assert kernel(torch.empty(0, 64).bfloat16(), w, None).shape == (0, 70)


def test_keeps_leading_dimensions() -> None:
    x = torch.randn(1, 5, 16).bfloat16()
    w = torch.randn(24, 16).bfloat16()
    assert kernel(x, w, None).shape == (1, 5, 24)


def test_bf16_tree_logits_equal_ar_logits_bit_for_bit(tiny_model) -> None:
    model = tiny_model.__wrapped__("llama", 0).to(torch.bfloat16)  # a fresh copy: the cached one stays fp32
    runner = ModelRunner(model, kernels="spectot")
    prefix, chain = [5, 9, 2, 31, 7], [11, 3, 40, 8]
    tree_sid, ar_sid = runner.new_stream(), runner.new_stream()
    runner.forward([StreamTree(s, TokenTree.chain(prefix)) for s in (tree_sid, ar_sid)])
    runner.commit_all()
    tree = runner.forward([StreamTree(tree_sid, TokenTree.chain(chain))]).logits[0]
    runner.commit({})
    for i, token in enumerate(chain):
        step = runner.forward([StreamTree(ar_sid, TokenTree.chain([token]))]).logits[0][0]
        runner.commit_all()
        assert torch.equal(tree[i], step)


@pytest.mark.parametrize(
    "family, overrides",
    [("llama", {}), ("qwen2", {}), ("llama", {"head_dim": 16})],  # the last: heads x head_dim (64) != hidden (32)
)
@pytest.mark.parametrize("exact", [True, False])  # a target's runner, a draft's (other matmul and attention paths)
def test_the_native_layer_loop_equals_the_python_loop_bit_for_bit(
    tiny_model, family: str, overrides: dict, exact: bool
) -> None:
    """decoder_stack.cpp runs the runner's layer loop in one call: logits, the hidden states a draft reads and
    the keys and values it writes must be the Python loop's, for one row and for trees."""
    model = tiny_model.__wrapped__(family, 1, **overrides).to(torch.bfloat16)
    runner = ModelRunner(model, kernels="spectot", exact_attention=exact)
    if runner._stack is None:
        pytest.skip("the native layer loop did not build here")
    stack = runner._stack
    sid = runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain([5, 9, 2, 31, 7, 4, 4, 8]))])
    runner.commit_all()
    trees = [TokenTree.chain([11]), TokenTree(torch.tensor([3, 40, 8, 2, 6]), torch.tensor([-1, 0, 0, 1, 3]))]
    for tree, hidden in [(trees[0], -2), (trees[0], None), (trees[1], -2)]:  # None: the one-row path
        results = []
        for native in (stack, None):
            runner._stack = native
            out = runner.forward([StreamTree(sid, tree)], hidden_layer=hidden)
            written = runner.cache.buffer[:, runner.cache.used - len(tree) : runner.cache.used].clone()
            runner.commit({})
            results.append((out.logits[0], written) + (() if hidden is None else (out.hidden[0],)))
        for native, python in zip(*results):
            assert torch.equal(native, python)
    # kept one-row steps leave the cache as the general path does, past a grown path buffer (64 slots) too
    paths = []
    for native in (stack, None):
        runner._stack = native
        fork = runner.new_stream(sid)
        for token in range(70):
            runner.forward([StreamTree(fork, TokenTree.chain([token % 30]))])
            runner.commit_all()
        paths.append(runner.cache.slots(fork).clone())
        runner.release(fork)
    assert torch.equal(paths[0], paths[1])


@pytest.mark.parametrize("exact", [True, False])
def test_forward_kept_equals_forward_then_commit_all(tiny_model, exact: bool) -> None:
    """A chain draft's depth in one call: the same logits and the same cache as forward + commit_all, on the
    native loop and without it; a verified chain keeping a prefix of its rows leaves the general commit's cache."""
    model = tiny_model.__wrapped__("llama", 1).to(torch.bfloat16)
    runner = ModelRunner(model, kernels="spectot", exact_attention=exact)
    stacks = [runner._stack, None] if runner._stack is not None else [None]
    sid = runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain([5, 9, 2, 31, 7]))])
    runner.commit_all()
    for stack in stacks:
        runner._stack = stack
        kept, general = runner.new_stream(sid), runner.new_stream(sid)
        for token in (11, 3, 40):
            logits = runner.forward_kept(kept, token)
            step = runner.forward([StreamTree(general, TokenTree.chain([token]))]).logits[0]
            runner.commit_all()
            assert torch.equal(logits, step)
        kv = runner.cache.buffer[:, runner.cache.slots(kept)]
        assert torch.equal(kv, runner.cache.buffer[:, runner.cache.slots(general)])
        with pytest.raises(RuntimeError, match="commit"):  # a pending forward is refused, as forward refuses it
            runner.forward([StreamTree(kept, TokenTree.chain([1]))])
            runner.forward_kept(kept, 2)
        runner.commit({})
        runner.release(kept)
        runner.release(general)
    # one stream keeping rows 0..1 of a 4-row chain: rows 2..3 leave, the cache stays dense and reads right
    runner._stack = stacks[0]
    before = runner.cache.used
    runner.forward([StreamTree(sid, TokenTree.chain([8, 6, 4, 2]))])
    runner.commit({sid: [0, 1]})
    assert runner.cache.used == before + 2 and runner.cache.slots(sid)[-2:].tolist() == [before, before + 1]
    alone = runner.new_stream()
    runner.forward([StreamTree(alone, TokenTree.chain([5, 9, 2, 31, 7, 8, 6]))])
    runner.commit_all()
    assert torch.equal(
        runner.cache.buffer[:, runner.cache.slots(sid)], runner.cache.buffer[:, runner.cache.slots(alone)]
    )


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("first_rows", [1, 4])  # the pending token alone; three catch-up entries before it
def test_draft_chain_equals_forward_then_forward_kept_steps(tiny_model, exact: bool, first_rows: int) -> None:
    """A greedy chain draft in one native call: the chain forward of its input rows, then one-row steps of each
    top-ranked head row's token. The same head rows, probabilities (softmax, topk: bit for bit) and cache as the
    Python steps, with a head over a token subset (``vocab``: head row -> token id, as a draft decoder's)."""
    model = tiny_model.__wrapped__("llama", 1).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(first_rows)
    vocab = torch.tensor([3, 17, 5, 40, 2, 29, 11, 8, 60, 33, 1, 47])  # head row i is token vocab[i]
    with torch.no_grad():
        model.lm_head = torch.nn.Linear(model.config.hidden_size, vocab.numel(), bias=False, dtype=torch.bfloat16)
        model.lm_head.weight.copy_(torch.randn(vocab.numel(), model.config.hidden_size, generator=gen))
    runner = ModelRunner(model, kernels="spectot", exact_attention=exact)
    if runner._stack is None:
        pytest.skip("the native layer loop did not build here")
    sid = runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain([5, 9, 2, 31, 7]))])
    runner.commit_all()
    x = torch.randn(first_rows, model.config.hidden_size, generator=gen).bfloat16()  # e.g. EDD's input vectors
    depths = 6
    results = []
    for native in (True, False):
        stream = runner.new_stream(sid)
        if native:
            probs, heads, own = runner.draft_chain(stream, x, depths, vocab, k=1)
            assert torch.equal(own, probs)  # no noise: each pick's own probability is its sorted value
            probs, heads = probs[:, 0].tolist(), heads[:, 0].tolist()
        else:
            tree = TokenTree.chain(torch.zeros(first_rows, dtype=torch.int64))
            logits = runner.forward([StreamTree(stream, tree, x)], logit_rows=[[first_rows - 1]]).logits[0]
            runner.commit_all()
            heads, probs = [], []
            for depth in range(depths):
                p, i = logits.softmax(-1).topk(1, dim=-1)
                heads.append(int(i))
                probs.append(float(p))
                if depth + 1 < depths:
                    logits = runner.forward_kept(stream, int(vocab[i]))
        kv = runner.cache.buffer[:, runner.cache.slots(stream)].clone()
        results.append((heads, probs, kv))
        runner.release(stream)
    assert results[0][:2] == results[1][:2]
    assert torch.equal(results[0][2], results[1][2])
    assert len(set(results[0][0])) > 1  # the chain moved through several tokens
    before = runner.cache.used
    with pytest.raises(ContextOverflowError):  # past the context: refused, no slot left reserved
        runner.draft_chain(sid, x, runner.max_context, vocab)
    assert runner.cache.used == before


def test_bf16_greedy_sd_equals_ar(tiny_model) -> None:
    model = tiny_model.__wrapped__("llama", 3).to(torch.bfloat16)
    decoder = Decoder(ModelRunner(model, kernels="spectot"), proposer=NgramProposer())
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7, 7]]
    ar = decoder.generate(prompts, DecodeConfig(max_new_tokens=40, method="ar"))
    sd = decoder.generate(prompts, DecodeConfig(max_new_tokens=40, method="sd", num_draft_tokens=4))
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    assert sum(r.stats.accepted for r in sd) > 0  # the drafts were exercised


# -- tree attention ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attention():
    kernel = tree_attention()
    if kernel is None:
        pytest.skip("the tree attention kernel needs an x86 CPU with AVX2 + FMA and a C++ toolchain")
    return kernel


def csr_layout(lengths: list[int], capacity: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r attends to lengths[r] distinct random slots in shuffled order: lengths [2, 3] might give
    columns = [7, 1 | 4, 0, 9] and row_ptr = [0, 2, 5]."""
    columns = torch.cat([torch.randperm(capacity, generator=gen)[:n] for n in lengths])
    return columns, torch.tensor([0, *accumulate(lengths)])


def reference_attention(q, kv, columns, row_ptr, scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v in float64 over each row's gathered slots -> (H, N, D)."""
    heads, rows, _ = q.shape
    group = heads // kv.shape[2]
    out = []
    for r in range(rows):
        slots = columns[row_ptr[r] : row_ptr[r + 1]]
        k, v = kv[slots].double().repeat_interleave(group, 2).unbind(1)  # (L, H, D) each
        weights = (torch.einsum("hd,lhd->hl", q[:, r].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(out, 1)


def random_problem(heads: int, kv_heads: int, dim: int, lengths: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    capacity = max(lengths) + 50
    q = (3 * torch.randn(heads, len(lengths), dim, generator=gen)).to(dtype)  # x3: peaked softmaxes too
    kv = torch.randn(capacity, 2, kv_heads, dim, generator=gen).to(dtype)
    return q, kv, *csr_layout(lengths, capacity, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(2, 2, 8), (9, 3, 64), (10, 2, 40), (4, 1, 24)])
@pytest.mark.parametrize("sharpness", [1.0, 30.0])  # 30: most exp(s - max) underflow to 0
def test_tree_attention_matches_float64_reference(
    attention, dtype, heads: int, kv_heads: int, dim: int, sharpness: float
) -> None:
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 100]
    q, kv, columns, row_ptr = random_problem(heads, kv_heads, dim, lengths, dtype, seed=dim + heads)
    scale = sharpness * dim**-0.5
    out = attention(q, kv, columns, row_ptr, scale)
    assert out.dtype == torch.float32 and out.shape == (heads, len(lengths), dim)
    # bf16 inputs are exact in fp32, so both dtypes see only fp32 rounding against the float64 result
    ref = reference_attention(q, kv, columns, row_ptr, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_row_is_computed_as_if_alone(attention, dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 120, (40,), generator=gen).tolist()
    q, kv, columns, row_ptr = random_problem(9, 3, 64, lengths, dtype, seed=7)
    batched = attention(q, kv, columns, row_ptr, 0.125)
    threads = torch.get_num_threads()
    try:  # which thread owns a row must not matter either
        torch.set_num_threads(1)
        assert torch.equal(attention(q, kv, columns, row_ptr, 0.125), batched)
    finally:
        torch.set_num_threads(threads)
    for r in range(len(lengths)):
        slots = columns[row_ptr[r] : row_ptr[r + 1]]
        alone = attention(q[:, r : r + 1].contiguous(), kv, slots, torch.tensor([0, len(slots)]), 0.125)
        assert torch.equal(alone[:, 0], batched[:, r])
        # the same K/V rows at other slots of a differently sized cache give the same bits
        moved = torch.randn(len(slots) + 300, *kv.shape[1:], generator=gen).to(dtype)
        new_slots = torch.randperm(len(moved), generator=gen)[: len(slots)]
        moved[new_slots] = kv[slots]
        relocated = attention(q[:, r : r + 1].contiguous(), moved, new_slots, torch.tensor([0, len(slots)]), 0.125)
        assert torch.equal(relocated[:, 0], batched[:, r])


def tree_layout(gen: torch.Generator, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as a verification lays them out: streams of shuffled cache slots (a reused cache is not in
    order), each followed by its tree's nodes at new slots, a node seeing its ancestors in order; some
    streams share a prefix (forks). Example: stream [5, 2, 9] with the chain at slots [20, 21] gives rows
    [5 2 9 20] and [5 2 9 20 21]."""
    slots = torch.randperm(capacity, generator=gen).tolist()
    columns, lengths, used = [], [], 0
    for stream in range(5):
        length = int(torch.randint(1, 200, (), generator=gen))
        history = (
            slots[used : used + length] if stream % 2 == 0 else columns[-1][: length // 2] + slots[used : used + length]
        )
        used += length
        nodes = int(torch.randint(1, 14, (), generator=gen))
        new = slots[used : used + nodes]
        used += nodes
        parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, nodes)]
        for i in range(nodes):
            path, node = [], i
            while node >= 0:
                path.insert(0, new[node])
                node = parents[node]
            columns.append(history + sorted(path) if stream == 3 else history + path)  # 3: ancestors out of order
            lengths.append(len(columns[-1]))
    return torch.tensor([c for row in columns for c in row]), torch.tensor([0, *accumulate(lengths)])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 32), (16, 1, 128), (4, 4, 64)])
def test_tree_attention_rows_of_trees_are_computed_as_if_alone(attention, heads, kv_heads, dim) -> None:
    """A verification's rows share their stream's columns, which the tile path reads once for a block of
    rows: each row must still get the bits it gets alone, in any thread count, and the reference's values."""
    gen = torch.Generator().manual_seed(heads * dim)
    capacity = 1400
    columns, row_ptr = tree_layout(gen, capacity)
    n = row_ptr.numel() - 1
    q = (3 * torch.randn(heads, n, dim, generator=gen)).bfloat16()
    kv = torch.randn(capacity, 2, kv_heads, dim, generator=gen).bfloat16()
    batched = attention(q, kv, columns, row_ptr, dim**-0.5)
    torch.testing.assert_close(
        batched.double(), reference_attention(q, kv, columns, row_ptr, dim**-0.5), rtol=1e-5, atol=1e-5
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attention(q, kv, columns, row_ptr, dim**-0.5), batched)
    finally:
        torch.set_num_threads(threads)
    for r in range(n):
        slots = columns[row_ptr[r] : row_ptr[r + 1]]
        alone = attention(q[:, r : r + 1].contiguous(), kv, slots, torch.tensor([0, len(slots)]), dim**-0.5)
        assert torch.equal(alone[:, 0], batched[:, r]), r


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (10, 2, 40), (4, 1, 24), (6, 3, 96)])
def test_tree_attention_bf16_rows_are_the_rounded_head_major_result(attention, heads, kv_heads, dim) -> None:
    """rows_bf16: (N, H * D) bf16, equal bit for bit to rounding the fp32 (H, N, D) result with torch and
    moving the heads into each row -- the three torch calls the runner no longer makes."""
    q, kv, columns, row_ptr = random_problem(heads, kv_heads, dim, [1, 5, 17, 64, 3], torch.bfloat16, seed=dim)
    head_major = attention(q, kv, columns, row_ptr, 0.3)
    rows = attention(q, kv, columns, row_ptr, 0.3, True)
    assert rows.dtype == torch.bfloat16 and rows.shape == (5, heads * dim)
    assert torch.equal(rows, head_major.to(torch.bfloat16).transpose(0, 1).reshape(5, -1))
    with pytest.raises(RuntimeError, match="rows_bf16 needs bf16"):
        attention(q.float(), kv.float(), columns, row_ptr, 0.3, True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=torch.zeros(2, 3, 16, dtype=torch.float64), kv=torch.zeros(9, 2, 1, 16, dtype=torch.float64)), "dtype"),
        (dict(q=torch.zeros(2, 3, 16, dtype=torch.bfloat16)), "share a dtype"),
        (dict(q=torch.zeros(2, 3, 12), kv=torch.zeros(9, 2, 1, 12)), "multiple of 8"),
        (dict(row_ptr=torch.tensor([0, 1, 3])), "N \\+ 1"),
        (dict(row_ptr=torch.tensor([0, 1, 1, 3])), "no columns"),
        (dict(columns=torch.tensor([0, 1, 9])), "outside the cache"),
        (dict(columns=torch.tensor([0, 1, 2], dtype=torch.int32)), "int64"),
        (dict(kv=torch.zeros(9, 2, 3, 16)), "multiple of 3 kv heads"),
        (dict(q=torch.zeros(0, 3, 16)), "0 query heads are not a positive multiple"),  # AMX builds: 16 / 0
    ],
)
def test_tree_attention_rejects_bad_input(attention, change: dict, message: str) -> None:
    args = dict(q=torch.zeros(2, 3, 16), kv=torch.zeros(9, 2, 1, 16), columns=torch.tensor([0, 1, 2]))
    args["row_ptr"] = torch.tensor([0, 1, 2, 3])
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        attention(args["q"], args["kv"], args["columns"], args["row_ptr"], 0.25)


def test_the_native_kernels_refuse_inputs_they_would_misread(tiny_model) -> None:
    """Each of these read or wrote out of bounds (AddressSanitizer), divided by zero or read past a bias: a
    layer of other widths than the first (the workspace is sized by it), a row pointer past the tails, no
    candidates per row, a short bias, an empty last dimension."""
    from spectot.engine.kernels import decoder_ops, decoder_stack

    stack_module, ops = decoder_stack(), decoder_ops()
    if stack_module is None or ops is None:
        pytest.skip("the native layer loop did not build here")
    pack, hidden = module.pack, 16
    norm = torch.ones(hidden).bfloat16()

    def weight(out: int, inp: int):
        return pack(torch.randn(out, inp).bfloat16())

    def add(stack, inner: int) -> None:
        stack.add_layer(
            *(norm, 1e-5, weight(32, hidden), None, 32, weight(hidden, 16), None, hidden, 0.35, norm, 1e-5),
            *(weight(2 * inner, hidden), None, 2 * inner, weight(hidden, inner), None, hidden),
        )

    for heads in ((2, 0), (3, 2), (0, 1)):  # a division by zero, or query heads that share no key-value head
        with pytest.raises(RuntimeError, match="not a positive multiple"):
            stack_module.DecoderStack(*heads)
    with pytest.raises(RuntimeError, match="head dim must be a positive multiple of 8"):
        stack_module.DecoderStack(4, 2).add_layer(  # 4 wide heads: the attention reads 8 lanes a step
            *(norm, 1e-5, weight(32, hidden), None, 32, weight(hidden, 16), None, hidden, 0.5, norm, 1e-5),
            *(weight(16, hidden), None, 16, weight(hidden, 8), None, hidden),
        )
    stack = stack_module.DecoderStack(2, 1)  # 2 query heads, 1 key-value head, 8 wide
    add(stack, 8)
    with pytest.raises(RuntimeError, match="the first layer's widths"):
        add(stack, 256)
    narrow = torch.zeros(1, 4, 1, 1, 8, dtype=torch.bfloat16)  # (layers, capacity, K and V: 2, H_kv, D)
    with pytest.raises(RuntimeError, match="buffer must be a contiguous bf16"):  # V was written past its end
        stack.forward(torch.zeros(1, hidden).bfloat16(), norm, norm, narrow, 0, *(torch.zeros(1).long(),) * 2, 1, 0, 0)
    half = weight(64, hidden)[..., :1].contiguous()  # each feature pair's second half missing: read past the end
    with pytest.raises(RuntimeError, match="weights packed by pack()"):
        module.linear(torch.randn(2, hidden).bfloat16(), half, None, 64, 1)
    with pytest.raises(RuntimeError, match="one entry per output feature"):
        module.linear(torch.randn(2, hidden).bfloat16(), weight(64, hidden), torch.zeros(3), 64, 1)
    for rows in (3, 9):  # no features: past 6 rows no pass over the panel wrote y (left uninitialised)
        with pytest.raises(RuntimeError, match="x has no features"):
            module.linear(torch.empty(rows, 0).bfloat16(), pack(torch.empty(64, 0).bfloat16()), None, 64, 1)
    with pytest.raises(RuntimeError, match="at least 1"):
        ops.rms_norm(torch.empty(3, 0).bfloat16(), torch.empty(0).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="even and positive"):
        ops.silu_mul(torch.empty(3, 0).bfloat16())

    # a draft tree's rows: the runner's own call, then the same with a bad row pointer or k = 0
    model = tiny_model.__wrapped__("llama", 1).to(torch.bfloat16)
    runner = ModelRunner(model, kernels="spectot")
    if runner._stack is None:
        pytest.skip("the native layer loop did not build here")
    calls: list[tuple] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def rows(self, *args):
            calls.append(args)
            return real.rows(*args)

    real, runner._stack = runner._stack, Recording()
    sid, scratch = runner.new_stream(), runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain([5, 9, 2, 31, 7]))])
    runner.commit_all()
    runner.draft_rows(sid, scratch, torch.tensor([3, 4]), [1, 1], [[], []], 2)
    args = list(calls[0])
    args[9] = torch.tensor([0, 1, 4000])  # tail_ptr past the 2 tails
    with pytest.raises(RuntimeError, match="tail_ptr must run from 0"):
        real.rows(*args)
    args = list(calls[0])
    args[2] = 0  # k
    with pytest.raises(RuntimeError, match="k must be >= 1"):
        real.rows(*args)
