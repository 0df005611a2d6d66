"""N-gram token trees: distinct latest-first continuations merged into a trie, and tree decoding
that is exactly greedy AR."""

from __future__ import annotations

import torch

from spectot.engine.runner import ModelRunner
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.proposers.base import DraftRequest
from spectot.spec.proposers.ngram import NgramProposer, lookup_continuations, trie
from spectot.spec.sampling import SamplingParams


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_trie_docstring_example() -> None:
    tokens, parents = trie([t(5, 6), t(5, 7), t(8)])
    assert tokens.tolist() == [5, 6, 7, 8]
    assert parents.tolist() == [-1, 0, 0, -1]


def test_continuations_are_distinct_and_latest_first() -> None:
    seq = t(1, 2, 9, 1, 2, 7, 1, 2, 9, 1, 2)
    found = lookup_continuations(seq, k=2, width=3)
    # matches of the trailing 2-gram [1, 2]... the 3-gram [9, 1, 2] wins first: only one match at 2
    assert [f.tolist() for f in found] == [[7, 1]]
    found = lookup_continuations(seq, k=2, width=3, max_ngram=2)
    assert [f.tolist() for f in found] == [[9, 1], [7, 1]]  # latest first, duplicates dropped


def test_width_one_keeps_the_chain_draft() -> None:
    seq = t(1, 2, 9, 1, 2, 7, 1, 2)
    request = [DraftRequest(0, seq, 3)]
    chain = NgramProposer(max_ngram=2).propose(request, SamplingParams(), None)[0]
    tree = NgramProposer(max_ngram=2, width=2).propose(request, SamplingParams(), None)[0]
    assert chain.parents is None and chain.tokens.tolist() == [7, 1, 2]
    assert tree.tokens.tolist() == [7, 1, 2, 9, 1, 2][:6] and tree.parents.tolist() == [-1, 0, 1, -1, 3, 4]


def test_greedy_tree_decoding_equals_ar(tiny_llama) -> None:
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], [7, 8, 7, 9, 7, 8, 7]]
    ar = Decoder(ModelRunner(tiny_llama(0))).generate(prompts, DecodeConfig(max_new_tokens=40))
    decoder = Decoder(ModelRunner(tiny_llama(0)), proposer=NgramProposer(width=4))
    sd = decoder.generate(prompts, DecodeConfig(max_new_tokens=40, method="sd", num_draft_tokens=4))
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    assert sum(r.stats.proposed for r in sd) > sum(r.stats.verify_steps for r in sd)  # real trees were verified
    decoder.prefix_cache.clear()
    assert decoder.runner.cache.used == 0  # nothing leaked outside the prefix cache
