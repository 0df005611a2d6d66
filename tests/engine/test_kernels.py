"""spectot's AVX2 bf16 linear kernel: accurate, and batch-invariant bit for bit (the property that
lets a tree forward reproduce the AR step exactly in bf16)."""

from __future__ import annotations

import pytest
import torch

from spectot.engine.kernels import bf16_linear
from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.proposers.ngram import NgramProposer

kernel = bf16_linear()
pytestmark = pytest.mark.skipif(kernel is None, reason="needs an x86 CPU with AVX2 + FMA and a C++ toolchain")


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


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 33])
def test_every_row_is_computed_as_if_alone(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(300, 96, generator=gen).bfloat16()
    batched = kernel(x, w, None)
    alone = torch.cat([kernel(x[i : i + 1], w, None) for i in range(rows)])
    assert torch.equal(batched, alone)


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


def test_bf16_greedy_sd_equals_ar(tiny_model) -> None:
    model = tiny_model.__wrapped__("llama", 3).to(torch.bfloat16)
    decoder = Decoder(ModelRunner(model, kernels="spectot"), proposer=NgramProposer())
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7, 7]]
    ar = decoder.generate(prompts, DecodeConfig(max_new_tokens=40, method="ar"))
    sd = decoder.generate(prompts, DecodeConfig(max_new_tokens=40, method="sd", num_draft_tokens=4))
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    assert sum(r.stats.accepted for r in sd) > 0  # the drafts were exercised
