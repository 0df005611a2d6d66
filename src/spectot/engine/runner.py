"""ModelRunner: one target forward over token trees appended to many streams, then commit.

The runner owns a model's flat KV cache (``kv_cache.py``) and its own attention; projections,
norms, MLPs and rotary embeddings are the checkpoint's modules. One ``forward`` lays the trees of
several streams side by side in a single sequence of N new tokens (batch dimension 1), so B streams
x k tree tokens cost one target forward with N = B*k rows: on a CPU in bf16 that costs little more
than one row. Each new token attends to its own stream's path and its tree ancestors (the native kernel reads
them from per-row slot lists; the fallback builds an additive mask); positions are stream length + depth. A
stream appears at most once in a forward.

Worked example: stream A (5 committed tokens, slots 0-4) gets the chain [x, y]; stream B, a fork of
A with 2 more tokens (slots 0-4, 5, 6) gets the single token [z]. New slots 7, 8, 9; positions
[5, 6, 7]; row x sees slots {0..4, 7}, y sees {0..4, 7, 8}, z sees {0..6, 9}.

``commit`` keeps the accepted root-to-node path of each stream's tree and removes every other new
slot, so the cache equals what prefilling the accepted tokens would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from spectot.engine.kv_cache import FlatKVCache
from spectot.engine.token_tree import TokenTree
from spectot.models.loader import check_architecture


def batch_invariant_attention(
    q: torch.Tensor,  # (H_kv, B, G*n, D): query head h_kv*G + g of row i at [h_kv, b, g*n + i]
    k: torch.Tensor,  # (H_kv, B, S, D) float64
    v: torch.Tensor,  # (H_kv, B, S, D) float64
    mask: torch.Tensor | None,  # (B, n, S) float64 additive; None: every row sees every column (n = 1)
    scale: float,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in float64 -> (H_kv, B, G*n, D) float64, for B padded streams.

    Why float64: a fused kernel's result for one query row depends on the other rows and on how many
    masked columns follow (its blocking changes), by ~1e-7 in fp32 and ~1e-4 in bf16 -- enough to
    flip a greedy near-tie between a tree forward and the AR step it must reproduce. In float64 the
    layout dependence is ~1e-16, far below one rounding step of the model dtype, so every row equals
    what the same token would get alone, however the streams are padded and batched.
    """
    h_kv, b, s, _ = k.shape
    scores = torch.matmul(q.double(), k.transpose(-1, -2)).mul_(scale)  # (H_kv, B, G*n, S)
    if mask is not None:  # query heads of a group share the mask
        scores.view(h_kv, b, -1, mask.shape[1], s).add_(mask[:, None])
    return torch.matmul(scores.softmax(-1).view(h_kv, b, -1, s), v)


def rotation_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D) cos and sin -> (N, 1, D) cos and signed sin [-sin_1, sin_2] (halves of the head dim), so that
    ``rotate`` needs no negation: transformers' rotate_half(x) * sin is [-x_2, x_1] * sin, and
    -x_2 * sin_1 == x_2 * -sin_1 bit for bit."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat([-sin[:, :half], sin[:, half:]], -1)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of (N, heads, D) rows, x cos + [x_2, x_1] signed_sin: the same products and sum as
    transformers' apply_rotary_pos_emb, in four ops for q and k together."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], -1) * signed_sin


def fused_attention(
    q: torch.Tensor,  # (H_kv, B, G*n, D)
    k: torch.Tensor,  # (H_kv, B, S, D)
    v: torch.Tensor,  # (H_kv, B, S, D)
    mask: torch.Tensor | None,  # (B, n, S) float64 additive; None: every row sees every column (n = 1)
    scale: float,
) -> torch.Tensor:
    """torch's fused SDPA in the model dtype -> (H_kv, B, G*n, D); not batch-invariant (see above)."""
    h_kv, b, gn, d = q.shape
    n = 1 if mask is None else mask.shape[1]
    q = q.view(h_kv, b, gn // n, n, d)
    k, v = k[:, :, None], v[:, :, None]  # broadcast over the group's query heads
    bias = None if mask is None else mask[:, None].to(q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return out.view(h_kv, b, gn, d)


LinearKernel = Literal["auto", "torch", "spectot", "tiled"]


@dataclass(frozen=True)
class Weight:
    """A linear layer's weight and bias in the layout the runner's matmul reads (``Matmul.prepare``)."""

    data: torch.Tensor
    bias: torch.Tensor | None
    out_features: int


class TorchMatmul:
    """torch's ``F.linear`` over the checkpoint's own tensors (fp32, GPUs, CPUs with AMX)."""

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Weight:
        return Weight(weight, bias, weight.shape[0])

    def __call__(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return torch.nn.functional.linear(x, w.data, w.bias)


class TiledMatmul(TorchMatmul):
    """torch's ``F.linear`` on tiles of exactly ``row_tile`` rows (the last one zero-padded), so a row's result
    cannot depend on how many rows share its forward: the library picks its kernel (tiling, reduction
    order) by the matrix shapes, and here every call on a weight has one shape. That makes fp32 batch-invariant
    (MKL's GEMV and GEMM round differently) and bf16 on a GPU as spectot's CPU kernel is (cuBLAS' kernels change
    with the row count: 4 of 35 EDD runs on an H200 left ar's greedy tokens at a near-tie). ``--kernels tiled``:
    64-row tiles on a GPU, about the price of a row where rows are nearly free (not measured yet); 8-row tiles
    on a CPU, where fp32 rows are not free (SmolLM2 fp32, 48 tokens of ``ar`` with the prompt's prefill, two runs:
    2.9-3.1 s on torch's, 4.7-5.8 s on 8-row tiles, 9.2-13.2 s on 64-row ones)."""

    def __init__(self, row_tile: int = 64) -> None:
        self.row_tile = row_tile

    def __call__(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:  # e.g. a draft catching up no hidden states
            return torch.nn.functional.linear(x, w.data, w.bias)
        tile = self.row_tile
        out = []
        for first in range(0, rows.shape[0], tile):
            part = rows[first : first + tile]
            n = part.shape[0]
            if n < tile:
                part = torch.cat([part, part.new_zeros(tile - n, part.shape[1])])
            out.append(torch.nn.functional.linear(part, w.data, w.bias)[:n])
        return (out[0] if len(out) == 1 else torch.cat(out)).view(*x.shape[:-1], w.out_features)


class SpectotMatmul:
    """spectot's batch-invariant bf16 kernel (``kernels/bf16_linear.cpp``). It reads weights packed once
    here into panels whose vector lanes are output columns (each build its own layout): the runner then holds
    each linear weight twice (the checkpoint's tensor stays, for the embedding and anyone calling the
    model), and a weight changed after the runner was built is not seen. On CPUs with AMX, forwards of
    ``amx_rows`` rows or more run on the tile unit. One SmolLM2 forward at a 128-token context on a 2-core
    Xeon with AMX (session 27, both paths interleaved in one run, median of 7), ms:

    | rows | 1 | 2 | 4 | 8 | 16 | 32 |
    |---|---:|---:|---:|---:|---:|---:|
    | AMX tiles | 15.2 | 16.4 | 15.8 | 17.6 | 20.0 | 31.4 |
    | vdpbf16ps | 14.0 | 16.9 | 17.7 | 24.0 | 40.2 | 75.2 |

    The two paths round differently in about 1 output in 10^4, so the runner takes the tiles from one row
    (``amx_rows`` = 1): every forward batch-invariant, bf16 trees equal to ``ar``'s, for 1-7 % of a one-row
    step (with the lanes for one row, every engine's bf16 ToT tree parted from ``ar``'s on 10 of 10 GSM8K
    problems, ``docs/results/bench_tot_xeon_s27_if5_lanes``). A draft's runner needs no batch invariance (its q is
    verified exactly whatever it is) and takes the lanes for one row (``amx_rows`` = 2, ``pick_linear``): one EDD row's
    forward + commit 560 -> 480 us on that Xeon (session 29, interleaved, three rounds)."""

    def __init__(self, module: Any, amx_rows: int = 1) -> None:
        self._module = module
        self.amx_rows = amx_rows

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Weight:
        with torch.no_grad():
            return Weight(self._module.pack(weight.detach()), bias, weight.shape[0])

    def __call__(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return self._module.linear(x, w.data, w.bias, w.out_features, self.amx_rows)


def pick_linear(
    dtype: torch.dtype, device: torch.device, choice: LinearKernel, batch_invariant: bool = True
) -> TorchMatmul | SpectotMatmul:
    """The matmul the runner uses: spectot's bf16 kernel on x86 CPUs ("auto" picks it: without native
    bf16, torch's kernel converts the weights for every row; with AVX512-BF16 but no AMX, measured on a
    2-core Zen 5 in session 19, one SmolLM2 forward takes 11-13 ms at 1 row and 13-14 ms at 6 with
    spectot's packed vdpbf16ps panels and fused ops, 30-36 ms and 34-40 ms with torch's kernels and ops;
    with AMX, session 27 on a 2-core Xeon: 15-20 ms at 1 row against torch's 36-57, see SpectotMatmul),
    else torch's ``F.linear``. "tiled": torch's on fixed row tiles (``TiledMatmul``), for bit-exact fp32 and
    batch-invariant bf16 on a GPU. ``batch_invariant=False`` (a draft): spectot's kernel takes the faster lanes
    for one row."""
    if choice == "tiled":
        return TiledMatmul(8 if device.type == "cpu" else 64)
    if choice == "torch" or dtype != torch.bfloat16 or device.type != "cpu":
        if choice == "spectot":
            raise ValueError("the spectot linear kernel is for bf16 on the CPU; use --kernels torch or --dtype bf16")
        return TorchMatmul()
    from spectot.engine.kernels import bf16_linear

    module = bf16_linear()
    if module is None:
        if choice == "spectot":
            raise ValueError("the spectot bf16 kernel needs an x86 CPU with AVX2 + FMA and a C++ compiler")
        return TorchMatmul()
    return SpectotMatmul(module, amx_rows=1 if batch_invariant else 2)


def pick_decoder_ops(config: Any, dtype: torch.dtype, device: torch.device, choice: LinearKernel) -> Any | None:
    """spectot's fused bf16 layer ops (``kernels/decoder_ops.cpp``: RMSNorm, rotary + KV write, SwiGLU
    gate) for Llama-family layers, unless ``--kernels torch`` asks for torch's ops everywhere; None
    where they do not apply (fp32 stays on the checkpoint's own modules, exact against transformers)
    or cannot be built. Measured on a 2-core Zen 5: one SmolLM2 row from 8.6 to 5.7 ms."""
    if choice == "torch" or dtype != torch.bfloat16 or device.type != "cpu":
        return None
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "model_type", None) == "qwen3":
        return None  # another activation, or per-head q/k norms before rotary (Qwen3)
    from spectot.engine.kernels import decoder_ops

    return decoder_ops()


def pick_attention_kernel(dtype: torch.dtype, device: torch.device, head_dim: int) -> Callable | None:
    """spectot's native batch-invariant attention (``kernels/tree_attention.cpp``: exact by
    construction, no float64) where it builds, else None: the runner's batched float64 path."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or head_dim % 8:
        return None
    from spectot.engine.kernels import tree_attention

    return tree_attention()


class ContextOverflowError(ValueError):
    """A stream would grow past the model's context."""


def _fuse(modules: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linear layers' weights into one (out_total, in) matrix and re-point each module's
    weight at its rows, so the fused matrix costs no extra memory and the model stays usable."""
    fused = torch.cat([m.weight.data for m in modules])
    offset = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight.data = fused[offset : offset + rows]
        offset += rows
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return fused, None
    return fused, torch.cat(
        [b.data if b is not None else fused.new_zeros(m.weight.shape[0]) for b, m in zip(biases, modules)]
    )


@dataclass(frozen=True)
class _Layer:
    """One decoder layer as its matmul's weights and plain callables: the hot loop does no module lookups."""

    input_norm: Any  # RMSNorm modules: the runner reads their weight and epsilon
    qkv: Weight  # (H_q*D + 2*H_kv*D, hidden): q, k, v projections, fused
    q_norm: Callable | None
    k_norm: Callable | None
    o: Weight
    scaling: float
    post_norm: Any
    gate_up: Weight  # (2 * intermediate, hidden): gate then up, fused
    down: Weight
    act: Callable

    @classmethod
    @torch.no_grad()
    def of(cls, layer: Any, matmul: TorchMatmul | SpectotMatmul) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            input_norm=layer.input_layernorm,
            qkv=matmul.prepare(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj])),
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
            o=matmul.prepare(attn.o_proj.weight, attn.o_proj.bias),
            scaling=float(attn.scaling),
            post_norm=layer.post_attention_layernorm,
            gate_up=matmul.prepare(*_fuse([mlp.gate_proj, mlp.up_proj])),
            down=matmul.prepare(mlp.down_proj.weight, mlp.down_proj.bias),
            act=mlp.act_fn,
        )


@dataclass(frozen=True)
class StreamTree:
    """A tree to append to one stream in a batched forward.

    ``embeds`` replaces the token embeddings of the tree's nodes: a draft decoder (EDD) feeds the
    target's hidden states this way as a soft prompt; ``tree.tokens`` then only label the nodes.
    """

    stream: int
    tree: TokenTree
    embeds: torch.Tensor | None = None  # (n, H) in the model's dtype, or None: embed tree.tokens


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor]  # per stream tree: (n_s, V) float32 on the host; (r_s, V) for the requested rows
    hidden: list[torch.Tensor] | None  # per stream tree: (n_s, H) at the chosen layer


@dataclass(frozen=True)
class _RowColumns:
    """The native kernel's layout: row r of the forward attends to columns[row_ptr[r] : row_ptr[r + 1]]."""

    columns: torch.Tensor  # (total,) cache slots
    row_ptr: torch.Tensor  # (N + 1,)


ATTENTION_BATCH_CELLS = 1 << 21  # padded (B x n x S) cells one attention batch may hold (x H doubles)


@dataclass(frozen=True)
class _AttentionBatch:
    """Streams attended together, padded to n rows and S columns each."""

    shape: tuple[int, int, int]  # (B, n, S)
    rows: torch.Tensor  # (B*n,) the forward row of each padded query (padding repeats the stream's first row)
    real: torch.Tensor | None  # the real rows among the B*n padded ones, in forward order; None: all are real
    columns: torch.Tensor  # (B*S,) the cache slot of each padded column (padding reads slot 0, masked out)
    mask: torch.Tensor | None  # (B, n, S) float64 additive (padded columns -inf, padded rows see everything);
    # None where every row sees every column: one row per stream and no padded column (an AR step)

    @classmethod
    def pad(
        cls, streams: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]], device: torch.device
    ) -> _AttentionBatch:
        """From (first row, rows, columns, mask) per stream; the index tensors reach the device in one copy."""
        n = max(rows for _, rows, _, _ in streams)
        s = max(columns.numel() for _, _, columns, _ in streams)
        b = len(streams)
        row_index = torch.zeros(b, n, dtype=torch.int64)
        real = torch.zeros(b, n, dtype=torch.bool)
        column_index = torch.zeros(b, s, dtype=torch.int64)
        mask = torch.zeros(b, n, s, dtype=torch.float64)
        for i, (first, rows, columns, stream_mask) in enumerate(streams):
            row_index[i] = first
            row_index[i, :rows] = torch.arange(first, first + rows)
            real[i, :rows] = True
            column_index[i, : columns.numel()] = columns
            mask[i, :rows, columns.numel() :] = float("-inf")
            mask[i, :rows, : columns.numel()] = stream_mask
        padded = any(rows < n for _, rows, _, _ in streams)
        sees_all = n == 1 and all(columns.numel() == s for _, _, columns, _ in streams)
        parts = [row_index.flatten(), column_index.flatten()] + ([real.flatten().nonzero()[:, 0]] if padded else [])
        index = torch.cat(parts).to(device)
        return cls(
            shape=(b, n, s),
            rows=index[: b * n],
            real=index[b * n + b * s :] if padded else None,
            columns=index[b * n : b * n + b * s],
            mask=None if sees_all else mask.to(device),
        )


def _row_index(rows: list[int]) -> torch.Tensor | slice:
    """Rows to select: a slice where they are consecutive (a view, no gather; none: an empty one), else an index
    tensor."""
    if not rows:  # e.g. a step that only fills part of a prompt: no logits wanted
        return slice(0, 0)
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64)


@dataclass
class _Pending:
    start: int  # first new slot
    offsets: list[int]  # node offset of each stream tree within the new slots
    trees: list[StreamTree]


class ModelRunner:
    def __init__(
        self,
        model: Any,
        *,
        max_context: int | None = None,
        capacity: int = 1024,
        kernels: LinearKernel = "auto",
        exact_attention: bool = True,
        native_attention: bool = True,
    ) -> None:
        """Attention runs in spectot's native kernel where it builds (CPU tensors; exact by construction,
        and the fastest: a 3-row draft forward of the one-layer EDD takes 0.41 ms with it against 0.62 ms
        with torch's fused SDPA on a 2-core Zen 5). Without it (a GPU, or ``native_attention=False``:
        the tests run a GPU's path on the CPU this way), ``exact_attention`` picks the batched float64
        path (targets: their rows must equal AR steps) or, with False, torch's fused SDPA, whose result
        for a row depends on the batch layout -- fine for a draft, since verification is exact for
        whatever q the draft reports. ``exact_attention=False`` also lets the matmul take its fastest
        path for one row (``pick_linear``)."""
        config = model.config
        limit = check_architecture(config)
        self.model = model
        self.max_context = min(limit, max_context or limit)
        inner = model.model
        self._embed = inner.embed_tokens
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        rope_type = str(getattr(self._rotary, "rope_type", "default"))
        # cos/sin of positions 0.. once, then indexed: the same elementwise values the module computes
        # per call (~25 us a forward, 6-7 % of a one-layer draft's); not for RoPE that rescales with length
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_cached = "dynamic" not in rope_type
        lm_head = model.get_output_embeddings()
        self.dtype = lm_head.weight.dtype
        self.device = lm_head.weight.device
        self._batch_invariant = exact_attention
        self._linear = pick_linear(self.dtype, self.device, kernels, batch_invariant=exact_attention)
        self._lm_head = self._linear.prepare(lm_head.weight, lm_head.bias)
        attn = inner.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_kv_heads = int(config.num_key_value_heads)
        self._layers = [_Layer.of(layer, self._linear) for layer in inner.layers]
        self._q_heads = self._layers[0].qkv.out_features // self.head_dim - 2 * self.num_kv_heads
        self.cache = FlatKVCache(
            num_layers=len(self._layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            capacity=capacity,
        )
        self._pending: _Pending | None = None
        self._attend = batch_invariant_attention if exact_attention else fused_attention
        self._attention_dtype = torch.float64 if exact_attention else self.dtype
        self._kernel = pick_attention_kernel(self.dtype, self.device, self.head_dim) if native_attention else None
        self._ops = pick_decoder_ops(config, self.dtype, self.device, kernels)
        self._stack = self._decoder_stack()

    def _decoder_stack(self) -> Any | None:
        """The layer loop as one native call (``kernels/decoder_stack.cpp``) where every kernel the loop runs is
        spectot's (bf16 on an x86 CPU): the same kernels in the same order, so the same results (measured:
        docs/ARCHITECTURE.md, ``kernels/``)."""
        if self._ops is None or self._kernel is None or not isinstance(self._linear, SpectotMatmul):
            return None
        from spectot.engine.kernels import decoder_stack

        module = decoder_stack()
        if module is None:
            return None
        stack = module.DecoderStack(self._q_heads, self.num_kv_heads)
        for layer in self._layers:
            stack.add_layer(
                layer.input_norm.weight.detach(),
                layer.input_norm.variance_epsilon,
                *(layer.qkv.data, layer.qkv.bias, layer.qkv.out_features),
                *(layer.o.data, layer.o.bias, layer.o.out_features),
                layer.scaling,
                layer.post_norm.weight.detach(),
                layer.post_norm.variance_epsilon,
                *(layer.gate_up.data, layer.gate_up.bias, layer.gate_up.out_features),
                *(layer.down.data, layer.down.bias, layer.down.out_features),
            )
        head = self._lm_head
        stack.set_ends(
            self._embed.weight.detach(), self._norm.weight.detach(), self._norm.variance_epsilon,
            head.data, head.bias, head.out_features,
        )  # fmt: skip
        return stack

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Weight:
        """A weight in the layout of the runner's matmul, for ``linear`` (a draft's own projections)."""
        return self._linear.prepare(weight, bias)

    def linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """x W^T (+ b) with the runner's matmul, over a ``prepare_linear`` weight."""
        with torch.inference_mode():
            return self._linear(x, weight)

    # -- streams ---------------------------------------------------------------------------
    def new_stream(self, fork_of: int | None = None) -> int:
        return self.cache.new_stream(fork_of)

    def length(self, stream: int) -> int:
        """Tokens whose KV ``stream`` holds (committed forwards only)."""
        return self.cache.length(stream)

    def release(self, stream: int) -> None:
        self._check_settled("release")
        self.cache.release(stream)

    def truncate(self, stream: int, length: int) -> None:
        self._check_settled("truncate")
        self.cache.truncate(stream, length)

    def _check_settled(self, what: str) -> None:
        """Freeing slots may shift the pending forward's slots down: its commit would then keep slots past the
        cache's end (the KV of another stream, in silence)."""
        if self._pending is not None:
            raise RuntimeError(f"{what}() while a forward is pending: commit() it first")

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        trees: Sequence[StreamTree],
        *,
        last_only: bool = False,
        logit_rows: Sequence[Sequence[int]] | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        """Run every stream's tree in one forward. ``last_only``: logits of each tree's last node
        only (a prefill or plain AR step); ``logit_rows``: logits of these nodes of each tree only
        (a drafter growing a tree needs its frontier). ``hidden_layer``: also return that hidden
        state for every node (transformers' ``hidden_states`` index: 0 = embeddings, i = output of
        decoder layer i, the last = after the final norm; negative counts from the end)."""
        if self._pending is not None:
            raise RuntimeError("commit() the previous forward before running the next one")
        if not trees:
            raise ValueError("forward needs at least one stream tree")
        only_row = logit_rows is None or (len(logit_rows) == 1 and list(logit_rows[0]) == [0])
        one_row = len(trees) == 1 and len(trees[0].tree) == 1 and only_row
        if self._stack is not None and one_row and hidden_layer is None:  # the hot path: nothing to check
            return self._forward_row(trees[0])
        if len({st.stream for st in trees}) != len(trees):  # both trees would sit at the stream's length
            raise ValueError(f"a stream appears twice in one forward: {[st.stream for st in trees]}")
        if logit_rows is not None and len(logit_rows) != len(trees):
            raise ValueError(f"logit_rows needs one list per tree: got {len(logit_rows)} for {len(trees)} trees")
        for i, st in enumerate(trees):  # a row past its tree read the next stream's logits, in silence
            n = len(st.tree)
            rows = logit_rows[i] if logit_rows is not None else ()
            if rows and (min(rows) < 0 or max(rows) >= n):
                raise ValueError(f"logit_rows of tree {i} must lie in [0, {n}), got {list(logit_rows[i])}")
            if st.embeds is not None and st.embeds.shape[0] != n:
                raise ValueError(f"tree {i} has {n} nodes but {st.embeds.shape[0]} embedding rows")
        n_hidden = len(self._layers) + 1
        if hidden_layer is not None and not -n_hidden <= hidden_layer < n_hidden:
            raise ValueError(f"hidden_layer {hidden_layer} is outside the model's {n_hidden} hidden states")
        span = 0  # positions 0 .. span - 1 occur in this forward
        for st in trees:
            span = max(span, self._context_end(st.stream, st.tree.depth + 1))
        sizes = [len(st.tree) for st in trees]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        total = sum(sizes)
        if last_only:
            logit_rows = [[n - 1] for n in sizes]
        hidden_index = None if hidden_layer is None else hidden_layer % n_hidden
        start = self.cache.reserve(total)  # outside inference mode: a grown cache's tensors stay normal ones
        try:
            logits, hidden = self._forward_reserved(trees, sizes, offsets, start, span, logit_rows, hidden_index)
        except BaseException:  # a failed forward (a bad id, out of memory, an interrupt) gives its slots back
            self.cache.drop_tail(start, check=False)
            raise
        self._pending = _Pending(start, offsets, list(trees))
        try:  # the host copy is where a device error (or a Ctrl-C) surfaces: nothing is left pending then
            logits = logits.float().cpu()  # host sync: sampling and verification run on the host
            per_stream = (
                [logits]
                if len(trees) == 1
                else list(logits.split(sizes if logit_rows is None else [len(rs) for rs in logit_rows]))
            )
            hidden_out = None if hidden is None else list(hidden.split(sizes))
            return ForwardOutput(per_stream, hidden_out)
        except BaseException:
            self.abort()
            raise

    def _forward_reserved(
        self,
        trees: Sequence[StreamTree],
        sizes: list[int],
        offsets: list[int],
        start: int,
        span: int,
        logit_rows: Sequence[Sequence[int]] | None,
        hidden_index: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's work of ``forward`` into the tail slots reserved from ``start``: (logits, hidden)."""
        # one inference-mode block for the whole forward: a one-layer draft's step is mostly ~5 us torch calls
        with torch.inference_mode():
            tokens = torch.cat([st.tree.tokens for st in trees]) if len(trees) > 1 else trees[0].tree.tokens
            embeds = self._embeds(trees, tokens.to(self.device))
            if len(trees) == 1 and trees[0].tree.is_chain:  # one chain: consecutive positions, sliced from the table
                first = self.cache.length(trees[0].stream)
                positions: torch.Tensor | slice = slice(first, first + sizes[0])
            else:
                positions = torch.cat([st.tree.depths + self.cache.length(st.stream) for st in trees]).to(self.device)
            layout = self._row_columns(trees, offsets, start) if self._kernel else self._batches(trees, offsets, start)
            rows = None if logit_rows is None else _row_index([o + r for o, rs in zip(offsets, logit_rows) for r in rs])
            if rows is not None and not isinstance(rows, slice):
                rows = rows.to(self.device)
            return self._run(embeds, positions, span, layout, start, rows, hidden_index)

    def _context_end(self, stream: int, new: int) -> int:
        """The stream's length once ``new`` more positions are appended; ContextOverflowError past the context."""
        end = self.cache.length(stream) + new
        if end > self.max_context:
            raise ContextOverflowError(
                f"stream would hold {end} tokens but the model's context is "
                f"{self.max_context}: shorten the prompt or lower max_new_tokens"
            )
        return end

    def _tiles(self, rows: int) -> bool:
        """Whether attention takes the kernel's tile path: always for a target (one path for every forward, batch
        invariance), from two rows for a draft (its one row is faster on the lanes)."""
        return self._batch_invariant or rows > 1

    def _forward_row(self, st: StreamTree) -> ForwardOutput:
        """``forward`` of one stream's single node (an AR step, a chain draft's depth) on the native loop, with the
        host work cut to what one row needs (it was ~45 % of a one-layer draft's step): its columns are a view of
        the stream's path with the new slot written past its end (``path_with``), positions a slice of the rotary
        table. The same inputs reach the same kernels as the general path, so the same results."""
        logits, start = self._row_logits(st.stream, st.tree.tokens, st.embeds)
        self._pending = _Pending(start, [0], [st])
        return ForwardOutput([logits], None)

    def forward_kept(self, stream: int, token: int) -> torch.Tensor:
        """``forward`` of ``token`` appended to ``stream`` and ``commit`` of it, in one call: its (1, vocab)
        float logits. A chain draft's depths: no tree, no pending forward, the new slot held by a slice."""
        if self._pending is not None:
            raise RuntimeError("commit() the previous forward before running the next one")
        if self._stack is None:
            out = self.forward([StreamTree(stream, TokenTree.chain([token]))])
            self.commit_all()
            return out.logits[0]
        logits, start = self._row_logits(stream, torch.tensor([token]), None)
        self.cache.hold_range(stream, start, 1)
        return logits

    @property
    def drafts_natively(self) -> bool:
        """Whether ``draft_chain`` and ``draft_rows`` run here (the native layer loop is built, RoPE from a table)."""
        return self._stack is not None and self._rope_cached

    def draft_chain(
        self,
        stream: int,
        x: torch.Tensor,
        depths: int,
        vocab: torch.Tensor,
        k: int = 1,
        temperature: float = 1.0,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A chain draft in one native call: the chain ``forward`` of x's rows (input vectors, appended to
        ``stream``), then ``depths`` - 1 ``forward_kept`` steps, each of the head row ranked first at the depth
        before (``vocab``: the token id of each head row). Each depth ranks the top ``k`` of q = softmax(logits /
        ``temperature``), largest first, except that with ``noise`` (depths, head rows) float64, E at each
        depth's position, the guess argmax q / E goes first (a coupled draft). Returns (probabilities, head rows,
        own probabilities), each (depths, k): the probabilities the sorted top k, the own ones each head row's q
        (the same but for a coupled guess); every row stays in the stream. The same ops on the
        same inputs as those Python steps, so the same bits, without their ~0.3 ms of host work a depth. None
        where the native loop is not built."""
        if not self.drafts_natively:
            return None
        if self._pending is not None:
            raise RuntimeError("commit() the previous forward before running the next one")
        rows = x.shape[0] + depths - 1
        first = self._context_end(stream, rows) - rows
        start = self.cache.reserve(rows)
        try:
            with torch.inference_mode():
                x = x.to(self._embed.weight)
                cos, sin = self._rope_tables(x, first + rows)
                probs, heads, own = self._stack.chain(
                    x, depths, k, cos, sin, self.cache.buffer, start, self.cache.slots(stream), vocab,
                    self._linear.amx_rows, self._batch_invariant, temperature, noise,
                )  # fmt: skip
        except BaseException:
            self.cache.drop_tail(start)  # the reserved slots, held by none
            raise
        self.cache.hold_range(stream, start, rows)
        return probs, heads, own

    def draft_rows(
        self,
        stream: int,
        scratch: int,
        tokens: torch.Tensor,
        depths: Sequence[int],
        above: Sequence[Sequence[int]],
        k: int,
        temperature: float = 1.0,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Nodes of a draft tree below ``stream``'s last token in one native call, their keys and values kept in
        ``scratch`` (a stream used as a list of slots: a compaction of the cache moves them with it): node r
        (token ``tokens[r]``, ``depths[r]`` below the stream's last token) becomes a new entry of ``scratch`` and
        attends to the stream's slots, then the ``scratch`` entries ``above[r]`` (its ancestors', root first),
        then its own. Returns each node's top ``k`` as ``draft_chain`` ranks them (``noise``: E at the nodes'
        children's position, (head rows,)), (probabilities, head rows, own probabilities), each (R, k):
        what a tree ``forward`` of those nodes gives (the same columns in the same order), without its tree,
        commit and cut. None where the native loop is not built."""
        if not self.drafts_natively:
            return None
        if self._pending is not None:
            raise RuntimeError("commit() the previous forward before running the next one")
        n = tokens.numel()
        if not len(depths) == len(above) == n:
            raise ValueError(f"one depth and one ancestor list per token: {len(depths)}, {len(above)} for {n}")
        entries = [i for ancestors in above for i in ancestors]
        if entries and not 0 <= min(entries) <= max(entries) < self.cache.length(scratch):
            raise ValueError(f"ancestor entries must index scratch's {self.cache.length(scratch)} entries: {above}")
        base = self.cache.length(stream) - 1  # the position of the stream's last token
        self._context_end(stream, max(depths))
        start = self.cache.reserve(n)
        held = self.cache.slots(scratch).tolist()  # after the reserve, which may have moved them
        tails, tail_ptr = [], [0]
        for r, ancestors in enumerate(above):
            tails += [held[i] for i in ancestors] + [start + r]
            tail_ptr.append(len(tails))
        try:
            with torch.inference_mode():
                x = self._embed.weight.index_select(0, tokens.to(self.device))
                cos, sin = self._rope_tables(x, base + max(depths) + 1)
                probs, heads, own = self._stack.rows(
                    x, torch.tensor([base + d for d in depths]), k, cos, sin, self.cache.buffer, start,
                    self.cache.slots(stream), torch.tensor(tails), torch.tensor(tail_ptr), self._linear.amx_rows,
                    self._batch_invariant, temperature, noise,
                )  # fmt: skip
        except BaseException:
            self.cache.drop_tail(start)
            raise
        self.cache.hold_range(scratch, start, n)
        return probs, heads, own

    def _rope_tables(self, x: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables (``_rope_form``), grown to hold positions 0 .. need - 1: doubled, up to the
        context (past it only as far as asked)."""
        held = 0 if self._rope_table is None else self._rope_table[0].shape[0]
        if held < need:
            length = max(need, min(max(256, 2 * held), self.max_context))
            self._rope_table = self._rope_form(*self._rotary(x, torch.arange(length, device=x.device)[None]))
        return self._rope_table

    def _row_logits(self, stream: int, token: torch.Tensor, embeds: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """One row on the native loop: its float logits and the tail slot it was written to (held by none yet)."""
        first = self._context_end(stream, 1) - 1
        start = self.cache.reserve(1)
        try:
            return self._row_logits_at(stream, token, embeds, first, start), start
        except BaseException:  # its slot goes back, as a failed ``forward``'s do
            self.cache.drop_tail(start, check=False)
            raise

    def _row_logits_at(
        self, stream: int, token: torch.Tensor, embeds: torch.Tensor | None, first: int, start: int
    ) -> torch.Tensor:
        columns = self.cache.path_with(stream, start)  # outside inference mode: a grown path stays a normal tensor
        with torch.inference_mode():
            if embeds is None:
                x = self._embed.weight.index_select(0, token.to(self.device))
            else:
                x = embeds.to(self._embed.weight)
            cos, sin = self._rope(x, slice(first, first + 1), first + 1)
            last, _ = self._stack.forward(
                x, cos, sin, self.cache.buffer, start, columns, torch.tensor([0, first + 1]),
                self._linear.amx_rows, self._tiles(1), 0,
            )  # fmt: skip
            return self._linear(self._rms_norm(self._norm, last), self._lm_head).float()

    def _embeds(self, trees: Sequence[StreamTree], tokens: torch.Tensor) -> torch.Tensor:
        """(N, H): the token embeddings, or the trees' own input vectors where given (in inference mode)."""
        x = self._embed.weight.index_select(0, tokens)  # the embedding module's lookup, without its call
        if all(st.embeds is None for st in trees):
            return x
        parts = x.split([len(st.tree) for st in trees])
        return torch.cat([p if st.embeds is None else st.embeds.to(p) for p, st in zip(parts, trees)])

    def _row_columns(self, trees: Sequence[StreamTree], offsets: list[int], start: int) -> _RowColumns:
        """Each new row's cache columns in path order: its stream's slots, then its tree ancestors'
        new slots (itself last) -- the very sequence the AR step for that token would read. (numpy:
        a one-layer draft's forward is short enough that torch's per-op overhead showed.)"""
        if len(trees) == 1 and len(trees[0].tree) == 1:  # one stream's AR or chain step: its slots, then the new one
            old = self.cache.slots(trees[0].stream)
            columns = torch.empty(old.numel() + 1, dtype=torch.int64)
            columns[:-1] = old
            columns[-1] = start + offsets[0]
            return _RowColumns(columns.to(self.device), torch.tensor([0, columns.numel()], device=self.device))
        values, counts = [], []
        for st, o in zip(trees, offsets):
            n = len(st.tree)
            old = self.cache.slots(st.stream).numpy()
            if n == 1:  # an AR step or a draft's chain step: the stream's slots, then its one new slot
                values += [old, np.array([start + o])]
                counts.append([old.size + 1])
                continue
            columns = np.empty((n, old.size + n), dtype=np.int64)
            columns[:, : old.size] = old
            columns[:, old.size :] = np.arange(start + o, start + o + n)
            # a chain's row i sees new slots 0..i (no ancestor mask to build: a verified chain's host work)
            seen = np.tri(n, dtype=bool) if st.tree.is_chain else st.tree.ancestors.numpy()
            visible = np.concatenate([np.ones((n, old.size), dtype=bool), seen], 1)
            values.append(columns[visible])  # row-major: row by row, columns in order
            counts.append(old.size + seen.sum(1))
        row_ptr = np.zeros(sum(len(c) for c in counts) + 1, dtype=np.int64)
        np.cumsum(np.concatenate(counts), out=row_ptr[1:])
        columns = torch.from_numpy(np.concatenate(values))
        return _RowColumns(columns.to(self.device), torch.from_numpy(row_ptr).to(self.device))

    def _batches(self, trees: Sequence[StreamTree], offsets: list[int], start: int) -> list[_AttentionBatch]:
        """The streams of a forward in consecutive attention batches: per stream, its rows, the cache
        columns they read (the stream's slots, then its new slots) and the additive float64 mask over
        those columns (0 = may attend, -inf = not), padded to the batch's largest stream. Attending per
        stream keeps the cost at each stream's own length, whatever else the cache holds.

        Example: stream A holds slots [0, 1, 2] and brings a 2-node chain written at slots [7, 8]:
        rows 0:2, columns [0, 1, 2, 7, 8], mask rows [0 0 0 0 -inf] and [0 0 0 0 0]."""
        streams = []
        for st, o in zip(trees, offsets):
            n = len(st.tree)
            old = self.cache.slots(st.stream)
            columns = torch.cat([old, torch.arange(start + o, start + o + n)])
            mask = torch.zeros(n, columns.numel(), dtype=torch.float64)
            mask[:, old.numel() :].masked_fill_(~st.tree.ancestors, float("-inf"))
            streams.append((o, n, columns, mask))
        groups: list[list[tuple]] = [[]]
        rows, cols = 0, 0
        for stream in streams:  # padded scores are H x B x n x S doubles: bound them per batch
            grown_rows, grown_cols = max(rows, stream[1]), max(cols, stream[2].numel())
            if groups[-1] and (len(groups[-1]) + 1) * grown_rows * grown_cols > ATTENTION_BATCH_CELLS:
                groups.append([])
                grown_rows, grown_cols = stream[1], stream[2].numel()
            groups[-1].append(stream)
            rows, cols = grown_rows, grown_cols
        return [_AttentionBatch.pad(group, self.device) for group in groups]

    def _run(
        self,
        embeds: torch.Tensor,  # (N, H)
        positions: torch.Tensor | slice,  # (N,), or a slice of consecutive positions
        span: int,  # max(positions) + 1, known on the host (reading it off the device would wait for it)
        layout: _RowColumns | list[_AttentionBatch],
        start: int,
        rows: torch.Tensor | slice | None,  # the rows whose logits are wanted (None: all)
        hidden_index: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        linear = self._linear
        x = embeds[None]  # (1, N, H)
        rope = self._rope(x, positions, span)
        hidden = x[0] if hidden_index == 0 else None
        if self._stack is not None and isinstance(layout, _RowColumns):  # the loop below in one native call
            after = hidden_index if hidden_index is not None and 0 < hidden_index < len(self._layers) else 0
            last, mid = self._stack.forward(
                embeds, *rope, self.cache.buffer, start, layout.columns, layout.row_ptr, linear.amx_rows,
                self._tiles(embeds.shape[0]), after,
            )  # fmt: skip
            x, hidden = last[None], mid if after else hidden
        else:
            for i, layer in enumerate(self._layers):
                x = x + self._attention(i, layer, self._rms_norm(layer.input_norm, x), rope, layout, start)
                x = x + self._mlp(layer, self._rms_norm(layer.post_norm, x))
                if hidden_index == i + 1 < len(self._layers):
                    hidden = x[0]
        final_hidden = hidden_index == len(self._layers)
        x = x[0] if rows is None or final_hidden else x[0, rows]  # the norm is per row: select first
        x = self._rms_norm(self._norm, x)
        if final_hidden:
            hidden = x
            x = x if rows is None else x[rows]
        return linear(x, self._lm_head), hidden

    def _rope(self, x: torch.Tensor, positions: torch.Tensor | slice, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's cos and sin at ``positions`` (a tensor, or a slice of consecutive ones) in the form
        the layers take (``_rope_form``), from a table of that form grown on demand (``need``: max(positions) + 1)."""
        if not self._rope_cached:
            if isinstance(positions, slice):
                positions = torch.arange(positions.start, positions.stop, device=x.device)
            return self._rope_form(*self._rotary(x, positions[None]))
        cos, sin = self._rope_tables(x, need)
        return cos[positions], sin[positions]

    def _rope_form(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, N, D) cos and sin -> the fused op's (N, D) cos and sin, or ``rotation_factors``' (N, 1, D)."""
        return (cos[0], sin[0]) if self._ops is not None else rotation_factors(cos[0], sin[0])

    def _rms_norm(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        if self._ops is None:  # transformers' RMSNorm in one call: equal bits in fp32; in bf16 one rounding, not two
            return torch.nn.functional.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
        return self._ops.rms_norm(x.contiguous(), norm.weight, norm.variance_epsilon)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(act(gate(x)) * up(x))."""
        gate_up = self._linear(x, layer.gate_up)
        if self._ops is not None:
            return self._linear(self._ops.silu_mul(gate_up), layer.down)
        gate, up = gate_up.chunk(2, -1)
        return self._linear(layer.act(gate) * up, layer.down)

    def _attention(
        self,
        index: int,
        layer: _Layer,
        x: torch.Tensor,  # (1, N, H)
        rope: tuple[torch.Tensor, torch.Tensor],  # the fused op's (cos, sin), else rotation_factors'
        layout: _RowColumns | list[_AttentionBatch],
        start: int,
    ) -> torch.Tensor:
        n_rows = x.shape[1]
        qkv = self._linear(x, layer.qkv)
        new = self.cache.buffer[index, start : start + n_rows]  # (N, 2, H_kv, D)
        if self._ops is not None:  # rotary q and k, k and v into the new slots, in one call
            q = self._ops.rope_store(qkv.view(n_rows, -1), *rope, new, self._q_heads, self.num_kv_heads)[None]
        else:  # torch ops (a GPU, fp32): few of them, since each costs a launch
            heads = qkv.view(n_rows, -1, self.head_dim)  # (N, H + 2 H_kv, D): q heads, k heads, v heads
            qk = heads[:, : self._q_heads + self.num_kv_heads]
            if layer.q_norm is not None:  # Qwen3 normalises heads before rotary
                qk = torch.cat([layer.q_norm(qk[:, : self._q_heads]), layer.k_norm(qk[:, self._q_heads :])], 1)
            qk = rotate(qk, *rope)
            new[:, 0] = qk[:, self._q_heads :]
            new[:, 1] = heads[:, self._q_heads + self.num_kv_heads :]
            q = qk[:, : self._q_heads].transpose(0, 1)[None]  # (1, H, N, D)
        kv = self.cache.buffer[index]  # (capacity, 2, H_kv, D)
        if isinstance(layout, _RowColumns):  # the native kernel reads each row's slots in place
            heads = q[0].contiguous()
            if x.dtype == torch.bfloat16:  # rows (N, H*D) in bf16 straight from the kernel, rounded as `to` rounds
                out = self._kernel(heads, kv, layout.columns, layout.row_ptr, layer.scaling, True, self._tiles(n_rows))
                return self._linear(out[None], layer.o)
            out = self._kernel(heads, kv, layout.columns, layout.row_ptr, layer.scaling)
            return self._linear(out.to(x.dtype).transpose(0, 1).reshape(1, n_rows, -1), layer.o)
        group = q.shape[1] // self.num_kv_heads
        parts = []
        for batch in layout:  # each stream attends only to its own slots
            b, n, s = batch.shape
            queries = q[0] if b == len(layout) == 1 else q[0][:, batch.rows]  # one stream: its rows in order
            queries = queries.view(self.num_kv_heads, group, b, n, -1).transpose(1, 2)
            keys_values = kv.index_select(0, batch.columns).view(b, s, *kv.shape[1:]).permute(2, 3, 0, 1, 4)
            keys_values = keys_values.to(self._attention_dtype, memory_format=torch.contiguous_format)
            out = self._attend(
                queries.reshape(self.num_kv_heads, b, group * n, -1), *keys_values, batch.mask, layer.scaling
            )
            # (H_kv, B, G*n, D) -> rows (B*n, H*D) in the model dtype, one copy (`to` alone keeps a
            # same-dtype tensor as it is, so reshape copies then)
            out = out.view(self.num_kv_heads, b, group, n, -1).permute(1, 3, 0, 2, 4)
            out = out.to(x.dtype, memory_format=torch.contiguous_format).reshape(b * n, -1)
            parts.append(out if batch.real is None else out[batch.real])
        out = torch.cat(parts) if len(parts) > 1 else parts[0]  # (N, H*D)
        return self._linear(out[None], layer.o)

    # -- commit ----------------------------------------------------------------------------
    def commit(self, accepted: dict[int, Sequence[int]] | None = None) -> None:
        """Keep, for each stream, the listed nodes of its tree (a root-to-node path, root first);
        drop every other new token. Streams left out keep nothing (a rollback)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("commit() without a forward")
        accepted = accepted or {}
        if not set(accepted) <= {st.stream for st in pending.trees}:
            self._pending = pending
            raise ValueError(f"accepted nodes for streams {sorted(set(accepted))} not all in the forward")
        paths = [list(accepted.get(st.stream, ())) for st in pending.trees]
        if all(st.tree.is_chain and nodes == list(range(len(st.tree))) for st, nodes in zip(pending.trees, paths)):
            for st, offset in zip(pending.trees, pending.offsets):  # every node kept (a prefill, an AR step): no
                first = pending.start + offset  # mask, nothing to remove
                self.cache.hold_range(st.stream, first, len(st.tree))
            return
        for st, nodes in zip(pending.trees, paths):  # validate everything before touching the cache
            if nodes and (not 0 <= nodes[-1] < len(st.tree) or nodes != st.tree.path_to(nodes[-1])):
                self._pending = pending
                raise ValueError(f"accepted nodes {nodes} are not a root-to-node path of the tree")
        if not any(paths):  # nothing kept (a draft's scratch forward): the new slots are the tail, held by none
            self.cache.drop_tail(pending.start, check=False)
            return
        if len(pending.trees) == 1:  # one stream's verified tree: its path's rows move down, the rest is the tail
            self.cache.keep_tail(pending.trees[0].stream, pending.start, paths[0])
            return
        keep = torch.zeros(self.cache.used - pending.start, dtype=torch.bool)
        for st, offset, nodes in zip(pending.trees, pending.offsets, paths):
            if nodes:
                slots = torch.tensor(nodes, dtype=torch.int64) + (pending.start + offset)
                self.cache.hold(st.stream, slots)
                keep[slots - pending.start] = True
        self.cache.remove((~keep).nonzero().squeeze(1) + pending.start)

    def abort(self) -> None:
        """Drop an uncommitted forward, if any (error recovery: the cache returns to its state before it)."""
        if self._pending is not None:
            self.commit({})

    def commit_all(self) -> None:
        """Keep every token of the last forward (all trees must be chains: a prefill or AR step)."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("commit_all() without a forward")
        self.commit({st.stream: range(len(st.tree)) for st in pending.trees})
