"""ModelRunner: one target forward over token trees appended to many streams, then commit.

The runner owns a model's flat KV cache (``kv_cache.py``) and its own attention; projections,
norms, MLPs and rotary embeddings are the checkpoint's modules. One ``forward`` lays the trees of
several streams side by side in a single sequence of N new tokens (batch dimension 1), so B streams
x k tree tokens cost one target forward with N = B*k rows: on a CPU in bf16 that costs little more
than one row. Each new token attends to its own stream's path and its tree ancestors through an
additive mask; positions are stream length + depth.

Worked example: stream A (5 committed tokens, slots 0-4) gets the chain [x, y]; stream B, a fork of
A with 2 more tokens (slots 0-4, 5, 6) gets the single token [z]. New slots 7, 8, 9; positions
[5, 6, 7]; row x sees slots {0..4, 7}, y sees {0..4, 7, 8}, z sees {0..6, 9}.

``commit`` keeps the accepted root-to-node path of each stream's tree and removes every other new
slot, so the cache equals what prefilling the accepted tokens would give.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

import torch

from spectot.engine.kv_cache import FlatKVCache
from spectot.engine.token_tree import TokenTree
from spectot.models.loader import check_architecture


def batch_invariant_attention(
    q: torch.Tensor,  # (H, N, D)
    k: torch.Tensor,  # (H_kv, S, D)
    v: torch.Tensor,  # (H_kv, S, D)
    mask: torch.Tensor,  # (N, S) float64 additive
    scale: float,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in float64 -> (H, N, D) float64.

    Why float64: a fused kernel's result for one query row depends on the other rows and on how many
    masked columns follow (its blocking changes), by ~1e-7 in fp32 and ~1e-4 in bf16 -- enough to
    flip a greedy near-tie between a tree forward and the AR step it must reproduce. In float64 the
    layout dependence is ~1e-16, far below one rounding step of the model dtype, so every row equals
    what the same token would get alone.
    """
    h_kv, s, d = k.shape
    group, n = q.shape[0] // h_kv, q.shape[1]
    q = q.double().reshape(h_kv, group * n, d)  # query head h uses key/value head h // group
    scores = torch.matmul(q, k.double().transpose(1, 2)).mul_(scale).view(h_kv, group, n, s).add_(mask)
    probs = scores.softmax(-1).view(h_kv, group * n, s)
    return torch.matmul(probs, v.double()).view(h_kv * group, n, d)


def fused_attention(
    q: torch.Tensor,  # (H, N, D)
    k: torch.Tensor,  # (H_kv, S, D)
    v: torch.Tensor,  # (H_kv, S, D)
    mask: torch.Tensor,  # (N, S) float64 additive
    scale: float,
) -> torch.Tensor:
    """torch's fused SDPA in the model dtype -> (H, N, D); not batch-invariant (see above)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale)


LinearKernel = Literal["auto", "torch", "spectot"]


def pick_linear(dtype: torch.dtype, device: torch.device, choice: LinearKernel) -> Callable:
    """The matmul the runner uses: spectot's batch-invariant bf16 kernel on CPUs without native
    bf16 ("auto" picks it there; with it a forward over n tree tokens costs about one token), else
    torch's ``F.linear``."""
    from torch.nn.functional import linear

    if choice == "torch" or dtype != torch.bfloat16 or device.type != "cpu":
        if choice == "spectot":
            raise ValueError("the spectot linear kernel is for bf16 on the CPU; use --kernels torch or --dtype bf16")
        return linear
    from spectot.engine.kernels import bf16_linear, cpu_has_native_bf16

    if choice == "auto" and cpu_has_native_bf16():
        return linear
    kernel = bf16_linear()
    if kernel is None:
        if choice == "spectot":
            raise ValueError("the spectot bf16 kernel needs an x86 CPU with AVX2 + FMA and a C++ compiler")
        return linear
    return kernel


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
    """One decoder layer as fused weights and plain callables: the hot loop does no module lookups."""

    input_norm: Callable
    qkv_weight: torch.Tensor  # (H_q*D + 2*H_kv*D, hidden): q, k, v projections, fused
    qkv_bias: torch.Tensor | None
    q_norm: Callable | None
    k_norm: Callable | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    scaling: float
    post_norm: Callable
    gate_up_weight: torch.Tensor  # (2 * intermediate, hidden): gate then up, fused
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None
    act: Callable

    @classmethod
    @torch.no_grad()
    def of(cls, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_weight, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up_weight, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        return cls(
            input_norm=layer.input_layernorm,
            qkv_weight=qkv_weight,
            qkv_bias=qkv_bias,
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
            o_weight=attn.o_proj.weight,
            o_bias=attn.o_proj.bias,
            scaling=float(attn.scaling),
            post_norm=layer.post_attention_layernorm,
            gate_up_weight=gate_up_weight,
            gate_up_bias=gate_up_bias,
            down_weight=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
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
    ) -> None:
        """``exact_attention=False`` uses torch's fused SDPA: faster, but a row's result then depends
        on the batch layout. Targets need exactness (their rows must equal AR steps); a draft does not
        (verification is exact for whatever q the draft reports), so draft runners use the fast path."""
        config = model.config
        limit = check_architecture(config)
        self.model = model
        self.max_context = min(limit, max_context or limit)
        inner = model.model
        self._embed = inner.embed_tokens
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._lm_head = model.get_output_embeddings()
        attn = inner.layers[0].self_attn
        self._apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.head_dim = int(attn.head_dim)
        self.num_kv_heads = int(config.num_key_value_heads)
        self._layers = [_Layer.of(layer) for layer in inner.layers]
        self._kv_size = self.num_kv_heads * self.head_dim
        self.dtype = self._lm_head.weight.dtype
        self.device = self._lm_head.weight.device
        self.cache = FlatKVCache(
            num_layers=len(self._layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            capacity=capacity,
        )
        self._pending: _Pending | None = None
        self._linear = pick_linear(self.dtype, self.device, kernels)
        self._attend = batch_invariant_attention if exact_attention else fused_attention

    # -- streams ---------------------------------------------------------------------------
    def new_stream(self, fork_of: int | None = None) -> int:
        return self.cache.new_stream(fork_of)

    def release(self, stream: int) -> None:
        self.cache.release(stream)

    def truncate(self, stream: int, length: int) -> None:
        self.cache.truncate(stream, length)

    def stream_len(self, stream: int) -> int:
        return self.cache.length(stream)

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
        for st in trees:
            depth = int(st.tree.depths.max()) + 1
            if self.cache.length(st.stream) + depth > self.max_context:
                raise ContextOverflowError(
                    f"stream would hold {self.cache.length(st.stream) + depth} tokens but the model's context is "
                    f"{self.max_context}: shorten the prompt or lower max_new_tokens"
                )
        sizes = [len(st.tree) for st in trees]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        total = sum(sizes)
        start = self.cache.reserve(total)
        tokens = torch.cat([st.tree.tokens for st in trees]).to(self.device)
        embeds = self._embeds(trees, tokens)
        positions = torch.cat([st.tree.depths + self.cache.length(st.stream) for st in trees]).to(self.device)
        segments = self._segments(trees, offsets, start)
        if last_only:
            logit_rows = [[n - 1] for n in sizes]
        rows = (
            None
            if logit_rows is None
            else torch.tensor(
                [o + r for o, rs in zip(offsets, logit_rows) for r in rs], dtype=torch.int64, device=self.device
            )
        )
        n_hidden = len(self._layers) + 1
        hidden_index = None if hidden_layer is None else hidden_layer % n_hidden
        with torch.inference_mode():  # the cache grew (reserve) outside: its tensors stay normal ones
            logits, hidden = self._run(embeds, positions, segments, start, rows, hidden_index)
        self._pending = _Pending(start, offsets, list(trees))
        logits = logits.float().cpu()  # host sync: sampling and verification run on the host
        per_stream = list(logits.split(sizes if logit_rows is None else [len(rs) for rs in logit_rows]))
        hidden_out = None if hidden is None else list(hidden.split(sizes))
        return ForwardOutput(per_stream, hidden_out)

    def _embeds(self, trees: Sequence[StreamTree], tokens: torch.Tensor) -> torch.Tensor:
        """(N, H): the token embeddings, or the trees' own input vectors where given."""
        with torch.inference_mode():
            x = self._embed(tokens)
        if all(st.embeds is None for st in trees):
            return x
        parts = x.split([len(st.tree) for st in trees])
        return torch.cat([p if st.embeds is None else st.embeds.to(p) for p, st in zip(parts, trees)])

    def _segments(
        self, trees: Sequence[StreamTree], offsets: list[int], start: int
    ) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
        """Per stream: its rows of this forward, the cache columns they read (the stream's slots, then
        its new slots) and the additive float64 mask over those columns (0 = may attend, -inf = not).
        Attending per stream keeps the cost at each stream's own length, whatever else the cache holds.

        Example: stream A holds slots [0, 1, 2] and brings a 2-node chain written at slots [7, 8]:
        rows 0:2, columns [0, 1, 2, 7, 8], mask rows [0 0 0 0 -inf] and [0 0 0 0 0]."""
        segments = []
        for st, o in zip(trees, offsets):
            n = len(st.tree)
            old = self.cache.slots(st.stream)
            columns = torch.cat([old, torch.arange(start + o, start + o + n)])
            mask = torch.zeros(n, old.numel() + n, dtype=torch.float64)
            mask[:, old.numel() :].masked_fill_(~st.tree.ancestors, float("-inf"))
            segments.append((slice(o, o + n), columns.to(self.device), mask.to(self.device)))
        return segments

    def _run(
        self,
        embeds: torch.Tensor,  # (N, H)
        positions: torch.Tensor,  # (N,)
        segments: list[tuple[slice, torch.Tensor, torch.Tensor]],  # per stream: rows, columns, mask
        start: int,
        rows: torch.Tensor | None,
        hidden_index: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        linear = self._linear
        x = embeds[None]  # (1, N, H)
        cos, sin = self._rotary(x, positions[None])
        hidden = x[0] if hidden_index == 0 else None
        for i, layer in enumerate(self._layers):
            x = x + self._attention(i, layer, layer.input_norm(x), cos, sin, segments, start)
            gate, up = linear(layer.post_norm(x), layer.gate_up_weight, layer.gate_up_bias).chunk(2, -1)
            x = x + linear(layer.act(gate) * up, layer.down_weight, layer.down_bias)  # SwiGLU MLP
            if hidden_index == i + 1 < len(self._layers):
                hidden = x[0]
        final_hidden = hidden_index == len(self._layers)
        x = x[0] if rows is None or final_hidden else x[0, rows]  # the norm is per row: select first
        x = self._norm(x)
        if final_hidden:
            hidden = x
            x = x if rows is None else x[rows]
        return linear(x, self._lm_head.weight, self._lm_head.bias), hidden

    def _attention(
        self,
        index: int,
        layer: _Layer,
        x: torch.Tensor,  # (1, N, H)
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: list[tuple[slice, torch.Tensor, torch.Tensor]],
        start: int,
    ) -> torch.Tensor:
        n = x.shape[1]
        shape = (1, n, -1, self.head_dim)
        qkv = self._linear(x, layer.qkv_weight, layer.qkv_bias)
        q, k, v = qkv.split([qkv.shape[-1] - 2 * self._kv_size, self._kv_size, self._kv_size], -1)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if layer.q_norm is not None:  # Qwen3 normalises heads before rotary
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = self._apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (1, H, N, D)
        kv = self.cache.buffer[index]  # (2, H_kv, capacity, D)
        kv[0, :, start : start + n] = k[0]
        kv[1, :, start : start + n] = v[0].transpose(0, 1)
        parts = []
        for row_slice, columns, mask in segments:  # each stream attends only to its own slots
            keys, values = kv[:, :, columns].unbind(0)  # (H_kv, S_stream, D) each
            parts.append(self._attend(q[0, :, row_slice], keys, values, mask, layer.scaling))
        out = torch.cat(parts, 1)  # (H, N, D)
        return self._linear(out.to(x.dtype).transpose(0, 1).reshape(1, n, -1), layer.o_weight, layer.o_bias)

    # -- commit ----------------------------------------------------------------------------
    def commit(self, accepted: dict[int, Sequence[int]] | None = None) -> None:
        """Keep, for each stream, the listed nodes of its tree (a root-to-node path, root first);
        drop every other new token. Streams left out keep nothing (a rollback)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("commit() without a forward")
        accepted = accepted or {}
        paths = [list(accepted.get(st.stream, ())) for st in pending.trees]
        for st, nodes in zip(pending.trees, paths):  # validate everything before touching the cache
            if nodes and (not 0 <= nodes[-1] < len(st.tree) or nodes != st.tree.path_to(nodes[-1])):
                self._pending = pending
                raise ValueError(f"accepted nodes {nodes} are not a root-to-node path of the tree")
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
