"""Static tree shapes against hand-made parent lists."""

from __future__ import annotations

import pytest

from spectot.engine.token_tree import TokenTree
from spectot.spec.trees.shapes import chain_tree, k_ary_tree, k_config_tree, specinfer_tree
import torch


def test_k_config_docstring_example() -> None:
    assert k_config_tree((2, 1)) == [-1, 0, 0, 1, 2]


def test_k_config_seed_shapes() -> None:
    assert len(k_config_tree((2, 2, 1))) == 1 + 2 + 4 + 4
    assert len(k_config_tree((4, 2, 1, 1))) == 1 + 4 + 8 + 8 + 8


def test_chain_and_k_ary() -> None:
    assert chain_tree(3) == [-1, 0, 1, 2]
    assert k_ary_tree(2, 2) == [-1, 0, 0, 1, 1, 2, 2]


def test_specinfer_sequences_share_only_the_root() -> None:
    parents = specinfer_tree(2, 3)
    assert parents == [-1, 0, 1, 2, 0, 4, 5]
    tree = TokenTree(torch.zeros(len(parents), dtype=torch.int64), torch.tensor(parents))
    assert tree.children(0) == [1, 4]
    assert int(tree.depths.max()) == 3


@pytest.mark.parametrize(
    "make",
    [
        lambda: k_config_tree(()),
        lambda: k_config_tree((2, 0)),
        lambda: chain_tree(0),
        lambda: specinfer_tree(0, 2),
        lambda: specinfer_tree(2, 0),
        lambda: k_ary_tree(2, 0),
    ],
)
def test_impossible_shapes_are_refused(make) -> None:
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("parents", [k_config_tree((4, 2, 1, 1)), specinfer_tree(5, 8), k_ary_tree(3, 3)])
def test_shapes_are_valid_token_trees(parents: list[int]) -> None:
    TokenTree(torch.zeros(len(parents), dtype=torch.int64), torch.tensor(parents))  # raises if malformed
