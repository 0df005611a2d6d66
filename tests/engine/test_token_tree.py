"""TokenTree: depths, ancestor masks, paths and children, and the validation of parent lists."""

from __future__ import annotations

import pytest
import torch

from spectot.engine.token_tree import TokenTree

# The module docstring's example: t0 -> a, t0 -> b, a -> c.
T0, A, B, C = 11, 12, 13, 14


@pytest.fixture
def example() -> TokenTree:
    return TokenTree(torch.tensor([T0, A, B, C]), torch.tensor([-1, 0, 0, 1]))


def test_docstring_example_depths_and_positions(example: TokenTree) -> None:
    assert example.depths.tolist() == [0, 1, 1, 2]
    assert (7 + example.depths).tolist() == [7, 8, 8, 9]
    assert len(example) == 4


def test_docstring_example_ancestors(example: TokenTree) -> None:
    # row i sees column j: t0: t0 / a: t0 a / b: t0 b / c: t0 a c
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(example.ancestors, expected)


def test_docstring_example_paths_and_children(example: TokenTree) -> None:
    assert example.path_to(0) == [0]
    assert example.path_to(2) == [0, 2]
    assert example.path_to(3) == [0, 1, 3]
    assert example.children(0) == [1, 2]
    assert example.children(1) == [3]
    assert example.children(2) == []
    assert example.children(3) == []


@pytest.mark.parametrize("n", [1, 2, 5])
def test_chain(n: int) -> None:
    tokens = list(range(100, 100 + n))
    tree = TokenTree.chain(tokens)
    assert tree.tokens.tolist() == tokens
    assert tree.tokens.dtype == torch.int64
    assert tree.parents.tolist() == list(range(-1, n - 1))
    assert tree.depths.tolist() == list(range(n))
    assert torch.equal(tree.ancestors, torch.ones(n, n, dtype=torch.bool).tril())
    assert tree.path_to(n - 1) == list(range(n))


def test_chain_accepts_a_tensor() -> None:
    tree = TokenTree.chain(torch.tensor([3, 1, 4], dtype=torch.int32))
    assert tree.tokens.dtype == torch.int64
    assert tree.tokens.tolist() == [3, 1, 4]


def test_deep_and_wide_tree_depths() -> None:
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tree = TokenTree(torch.arange(7), torch.tensor(parents))
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    for node in range(7):
        path = tree.path_to(node)
        assert len(path) == int(tree.depths[node]) + 1
        # a node's ancestors are exactly its root-to-node path
        assert tree.ancestors[node].nonzero().squeeze(1).tolist() == path


@pytest.mark.parametrize("n", [7, 40])  # row by row up to 16 nodes, level by level beyond
def test_ancestors_are_every_nodes_root_path(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    parents = [-1] + [int(torch.randint(i, (), generator=generator)) for i in range(1, n)]
    tree = TokenTree(torch.arange(n), torch.tensor(parents))
    for node in range(n):
        path = tree.path_to(node)
        assert tree.ancestors[node].nonzero().squeeze(1).tolist() == path
        assert int(tree.depths[node]) == len(path) - 1


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ([], []),  # no root
        ([1, 2], [0, 0]),  # root's parent is not -1
        ([1, 2], [-1, 1]),  # a node is its own parent
        ([1, 2, 3], [-1, 2, 0]),  # a parent that comes later
        ([1, 2], [-1, -1]),  # a second root
        ([1, 2, 3], [-1, 0]),  # fewer parents than tokens
        ([1, 2], [-1, 0, 1]),  # more parents than tokens
    ],
)
def test_invalid_parents_raise(tokens: list[int], parents: list[int]) -> None:
    with pytest.raises(ValueError):
        TokenTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))
