"""Errors lose nothing: a refused commit, an exception mid-step and a draft that runs out of context
leave the engine usable and the output unchanged."""

from __future__ import annotations

import pytest
import torch

from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.proposers.draft_model import DraftModelProposer


def test_refused_commit_changes_nothing(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(0))
    sid = runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain([1, 2, 3]))])
    runner.commit_all()
    tree = TokenTree(torch.tensor([4, 5, 6, 7]), torch.tensor([-1, 0, 0, 1]))
    runner.forward([StreamTree(sid, tree)])
    with pytest.raises(ValueError, match="root-to-node path"):
        runner.commit({sid: [0, 2, 3]})
    assert runner.length(sid) == 3  # nothing was kept ...
    runner.commit({sid: [0, 1, 3]})  # ... and the forward can still be committed correctly
    assert runner.length(sid) == 6
    assert runner.cache.used == 6


def test_exception_mid_step_leaves_the_decoder_usable(tiny_llama) -> None:
    calls = {"n": 0}

    def flaky_detokenize(ids: list[int]) -> str:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("detokenizer failed")
        return " ".join(map(str, ids))

    decoder = Decoder(ModelRunner(tiny_llama(0)), detokenize=flaky_detokenize)
    config = DecodeConfig(max_new_tokens=6, stop=("never",))
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        decoder.generate([[1, 2, 3]], config)
    assert decoder.runner.cache.used == 0  # the failed call released everything it held
    again = decoder.generate([[1, 2, 3]], config)[0]
    plain = Decoder(ModelRunner(tiny_llama(0)), detokenize=flaky_detokenize).generate([[1, 2, 3]], config)[0]
    assert again.token_ids == plain.token_ids


def test_draft_with_a_short_context_stops_drafting_not_decoding(tiny_llama) -> None:
    target = ModelRunner(tiny_llama(0))
    draft = DraftModelProposer(ModelRunner(tiny_llama(0), max_context=16))  # same weights: always agrees
    prompt = list(range(1, 11))
    config = DecodeConfig(max_new_tokens=20, method="sd", num_draft_tokens=3)
    sd = Decoder(target, proposer=draft).generate([prompt], config)[0]
    ar = Decoder(ModelRunner(tiny_llama(0))).generate([prompt], DecodeConfig(max_new_tokens=20))[0]
    assert sd.token_ids == ar.token_ids
    assert sd.stats.accepted > 0
