"""spectot's fused bf16 layer ops (``kernels/decoder_ops.cpp``) against the transformers modules they
replace, row by row, and inside the runner."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from spectot.engine.kernels import decoder_ops
from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree

ops = decoder_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="needs an x86 CPU with AVX2 + FMA and a C++ toolchain")


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between same-signed values (the bit patterns are ordered)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def test_rms_norm_matches_transformers_within_one_bf16_step() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(576, generator=gen)).bfloat16()
    x = (3 * torch.randn(1, 40, 576, generator=gen)).bfloat16()
    ours, theirs = ops.rms_norm(x, norm.weight.data, norm.variance_epsilon), norm(x)
    assert ours.shape == theirs.shape and ours.dtype == torch.bfloat16
    assert ulps_apart(ours, theirs).max() <= 1
    assert (ours == theirs).float().mean() > 0.99  # only the fp32 sum order differs


def test_rope_store_is_transformers_rotary_bit_for_bit_and_fills_the_cache() -> None:
    gen = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 7, 9, 3, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).bfloat16()
    angles = torch.arange(n)[:, None] * torch.rand(d // 2, generator=gen)[None] * 3
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()
    new_kv = torch.zeros(n, 2, hkv, d, dtype=torch.bfloat16)
    q = ops.rope_store(qkv, cos, sin, new_kv, hq, hkv)

    q_ref, k_ref, v_ref = qkv.view(1, n, -1, d).split([hq, hkv, hkv], 2)
    q_ref, k_ref = apply_rotary_pos_emb(q_ref.transpose(1, 2), k_ref.transpose(1, 2), cos[None], sin[None])
    assert torch.equal(q, q_ref[0])  # (Hq, N, D)
    assert torch.equal(new_kv[:, 0], k_ref[0].transpose(0, 1))
    assert torch.equal(new_kv[:, 1], v_ref[0])


def test_silu_mul_matches_transformers_within_one_bf16_step() -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (4 * torch.randn(1, 9, 2 * 1536, generator=gen)).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    ours, theirs = ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up
    assert ours.shape == (1, 9, 1536)
    assert ulps_apart(ours, theirs).max() <= 1
    assert (ours == theirs).float().mean() > 0.99  # only exp's last fp32 bit may differ


def test_every_row_is_computed_as_if_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 96, generator=gen).bfloat16()
    w = torch.randn(96, generator=gen).bfloat16()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), torch.cat([ops.rms_norm(r[None], w, 1e-6) for r in x]))
    assert torch.equal(ops.silu_mul(x), torch.cat([ops.silu_mul(r[None]) for r in x]))
    cos, sin = torch.randn(11, 8, generator=gen).bfloat16(), torch.randn(11, 8, generator=gen).bfloat16()
    qkv = torch.randn(11, 4 * 8, generator=gen).bfloat16()
    together = ops.rope_store(qkv, cos, sin, torch.empty(11, 2, 1, 8, dtype=torch.bfloat16), 2, 1)
    alone = [
        ops.rope_store(qkv[i : i + 1], cos[i : i + 1], sin[i : i + 1], torch.empty(1, 2, 1, 8).bfloat16(), 2, 1)
        for i in range(11)
    ]
    assert torch.equal(together, torch.cat(alone, 1))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-6), "bf16"),
        (lambda: ops.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(6).bfloat16(), 1e-6), "last dimension"),
        (lambda: ops.silu_mul(torch.randn(2, 7).bfloat16()), "even"),
        (
            lambda: ops.rope_store(
                torch.randn(3, 40).bfloat16(),
                *torch.randn(2, 3, 8).bfloat16(),
                torch.empty(3, 2, 1, 8).bfloat16(),
                2,
                1,
            ),
            "qkv must be",
        ),
    ],
)
def test_bad_input_is_refused_with_a_message(call, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_runner_with_fused_ops_matches_the_checkpoints_modules(tiny_model, family: str) -> None:
    model = tiny_model.__wrapped__(family, 0).to(torch.bfloat16)  # a fresh copy: the cached one stays fp32
    fused, plain = ModelRunner(model, kernels="spectot"), ModelRunner(model, kernels="spectot")
    plain._ops = None  # the checkpoint's own norm, rotary and activation modules
    assert fused._ops is not None
    tokens = TokenTree.chain([5, 9, 2, 31, 7, 11, 3, 40])
    logits = []
    for runner in (fused, plain):
        logits.append(runner.forward([StreamTree(runner.new_stream(), tokens)]).logits[0])
        runner.commit_all()
    assert torch.allclose(logits[0], logits[1], atol=0.05, rtol=0.02)


def test_fused_ops_are_for_bf16_llama_family_layers_only(tiny_model) -> None:
    assert ModelRunner(tiny_model("llama", 0))._ops is None  # fp32 stays on the modules, exact against HF
    bf16 = tiny_model.__wrapped__("llama", 0).to(torch.bfloat16)
    assert ModelRunner(bf16, kernels="torch")._ops is None
    assert ModelRunner(bf16, kernels="spectot")._ops is not None
    qwen3 = tiny_model.__wrapped__("qwen3", 0).to(torch.bfloat16)  # per-head q/k norms before rotary
    assert ModelRunner(qwen3, kernels="spectot")._ops is None
