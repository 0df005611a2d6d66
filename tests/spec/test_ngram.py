"""Prompt-lookup drafting against hand-made token streams."""

from __future__ import annotations

import pytest
import torch

from spectot.spec.proposers.base import DraftRequest
from spectot.spec.proposers.ngram import NgramProposer, graft, lookup_match
from spectot.spec.sampling import SamplingParams


def lookup(tokens: list[int], k: int, **kwargs) -> list[int]:
    out = lookup_match(torch.tensor(tokens, dtype=torch.int64), k, **kwargs)[0]
    assert out.dtype == torch.int64 and out.dim() == 1
    return out.tolist()


@pytest.mark.parametrize(
    ("tokens", "k", "kwargs", "expected"),
    [
        # the docstring example: trailing [5, 6] occurred at 0
        ([5, 6, 7, 9, 5, 6], 2, {}, [7, 9]),
        # the latest earlier match wins: [1, 2] at 0 and at 3, the one at 3 is followed by 4
        ([1, 2, 3, 1, 2, 4, 1, 2], 1, {}, [4]),
        # a 3-gram match beats a later 2-gram match: [1, 2, 3] at 0 -> 8, 5; [2, 3] at 5 -> 9, 1
        ([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3], 2, {}, [8, 5]),
        # no 3-gram match ([9, 2, 3]), so the 2-gram [2, 3] at 1
        ([4, 2, 3, 7, 9, 2, 3], 2, {}, [7, 9]),
        # neither [6, 1, 5] nor [1, 5] occurred, so the 1-gram [5] at 1
        ([4, 5, 6, 1, 5], 2, {}, [6, 1]),
        # max_ngram caps the n-gram: only [3] is looked up, latest at 6
        ([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3], 2, {"max_ngram": 1}, [9, 1]),
        # min_ngram forbids the 1-gram fallback of the case above
        ([4, 5, 6, 1, 5], 2, {"min_ngram": 2}, []),
        # nothing ever repeats
        ([1, 2, 3, 4, 5], 3, {}, []),
        # the last token appeared only as the last token
        ([7, 7, 7, 8], 2, {}, []),
    ],
)
def test_lookup_continuation(tokens: list[int], k: int, kwargs: dict, expected: list[int]) -> None:
    assert lookup(tokens, k, **kwargs) == expected


@pytest.mark.parametrize(
    ("tokens", "n"),
    [([1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3], 3), ([4, 2, 3, 7, 9, 2, 3], 2), ([4, 5, 6, 1, 5], 1), ([1, 2, 3], 0)],
)
def test_lookup_match_reports_the_matched_length(tokens: list[int], n: int) -> None:
    continuation, matched = lookup_match(torch.tensor(tokens, dtype=torch.int64), 2)
    assert matched == n and continuation.tolist() == lookup(tokens, 2)


def test_drafts_carry_their_match_and_cut_to_a_prefix() -> None:
    request = DraftRequest(0, torch.tensor([5, 6, 7, 9, 3, 4, 5, 6]), 4)
    [draft] = NgramProposer().propose([request], SamplingParams(), None)
    assert draft.match == 2 and draft.tokens.tolist() == [7, 9, 3, 4]
    cut = draft.cut(2)
    assert cut.tokens.tolist() == [7, 9] and cut.match == 2 and cut.q is None
    [tree] = NgramProposer(width=2).propose(
        [DraftRequest(0, torch.tensor([1, 2, 8, 1, 2, 9, 1, 2]), 2)], SamplingParams(), None
    )
    with pytest.raises(ValueError, match="chain"):
        tree.cut(1)


def test_continuation_truncated_at_k() -> None:
    tokens = [5, 6, 7, 9, 3, 4, 5, 6]  # [5, 6] at 0 -> 7, 9, 3, 4, ...
    assert lookup(tokens, 1) == [7]
    assert lookup(tokens, 3) == [7, 9, 3]
    assert lookup(tokens, 0) == []


def test_continuation_truncated_at_end_of_sequence() -> None:
    # [1, 2] at 0 is followed by only 9, 1, 2 before the stream ends
    assert lookup([1, 2, 9, 1, 2], 5) == [9, 1, 2]
    # overlapping repeat: [3, 3] at 0 is followed by a single 3
    assert lookup([3, 3, 3], 4) == [3]


@pytest.mark.parametrize("tokens", [[], [4]])
def test_too_short_stream_gives_no_draft(tokens: list[int]) -> None:
    assert lookup(tokens, 3) == []


def test_ngram_longer_than_stream_falls_back() -> None:
    # max_ngram 5 exceeds what a 3-token stream can match; [2] at 0 still matches
    assert lookup([2, 8, 2], 2, max_ngram=5) == [8, 2]


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(3, 2), (0, 3), (2, 1)])
def test_proposer_rejects_bad_ngram_range(min_ngram: int, max_ngram: int) -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram)


def test_proposer_drafts_each_request_deterministically() -> None:
    proposer = NgramProposer(max_ngram=2, min_ngram=1)
    requests = [
        DraftRequest(key=0, tokens=torch.tensor([5, 6, 7, 9, 5, 6]), k=2),
        DraftRequest(key=1, tokens=torch.tensor([1, 2, 3]), k=4),
        DraftRequest(key=2, tokens=torch.tensor([4, 5, 6, 1, 5]), k=1),
    ]
    drafts = proposer.propose(requests, SamplingParams(do_sample=True), torch.Generator().manual_seed(0))
    assert [d.tokens.tolist() for d in drafts] == [[7, 9], [], [6]]
    assert all(d.q is None for d in drafts)  # one-hot: verified as a deterministic draft
    assert proposer.forwards == 0


@pytest.mark.parametrize(
    ("tokens", "parents", "branch", "expected"),
    [
        # the docstring example: the branch shares the chain's first node, then leaves it
        ([5, 6, 7], [-1, 0, 1], [5, 8, 9], ([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3], [0, 3, 4])),
        # a branch the chain already holds adds nothing
        ([5, 6, 7], [-1, 0, 1], [5, 6], ([5, 6, 7], [-1, 0, 1], [0, 1])),
        # one that runs past the chain's end extends it
        ([5, 6], [-1, 0], [5, 6, 7], ([5, 6, 7], [-1, 0, 1], [0, 1, 2])),
        # a branch that disagrees at once hangs from the root
        ([5, 6], [-1, 0], [9, 6], ([5, 6, 9, 6], [-1, 0, -1, 2], [2, 3])),
        # in a tree it follows the sibling it agrees with (the second child of the root here)
        ([5, 8, 6], [-1, -1, 0], [8, 2], ([5, 8, 6, 2], [-1, -1, 0, 1], [1, 3])),
        # an empty draft becomes the branch
        ([], [], [4, 4], ([4, 4], [-1, 0], [0, 1])),
    ],
)
def test_graft(tokens, parents, branch, expected) -> None:
    assert graft(tokens, parents, branch) == expected
