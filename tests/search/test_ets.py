"""ETS's selection ILP (KV cost and semantic coverage against REBASE's allocation) and its step clustering."""

from __future__ import annotations

import numpy as np
import pytest

from spectot.search.ets import ets_retain, ets_select, semantic_clusters
from spectot.search.rebase import rebase_widths

# root r; leaves a1, a2 under node a; b1 under b; c1 under c (the module docstring's worked example)
PATHS = [["r", "a"], ["r", "a"], ["r", "b"], ["r", "c"]]
DISTINCT = [0, 1, 2, 3]


def test_zero_lambdas_are_exactly_rebase() -> None:
    rewards = [0.9, 0.4, 0.7, 0.1]
    widths = ets_select(rewards, PATHS, DISTINCT, 16, lambda_kv=0.0, lambda_cov=0.0)
    assert widths == rebase_widths(rewards, 16)
    assert ets_retain(rewards, PATHS, DISTINCT, 16, lambda_kv=0.0, lambda_cov=0.0) == [True] * 4


def test_kv_cost_keeps_leaves_that_share_ancestors() -> None:
    equal = [0.8] * 4
    assert ets_select(equal, PATHS, DISTINCT, 8, lambda_kv=0.0, lambda_cov=0.0) == [2, 2, 2, 2]
    # O = 1/4 each, C = 1/8: a2 adds 1/4 - 1.5/8 > 0 (shares r, a), b1 or c1 adds 1/4 - 3/8 < 0
    assert ets_select(equal, PATHS, DISTINCT, 8, lambda_kv=1.5, lambda_cov=0.0) == [4, 4, 0, 0]


def test_large_kv_cost_keeps_a_single_leaf() -> None:
    widths = ets_select([0.8, 0.3, 0.5, 0.6], PATHS, DISTINCT, 8, lambda_kv=100.0, lambda_cov=0.0)
    assert widths == [8, 0, 0, 0]  # sum x_i >= 1 keeps the best leaf alone


def test_coverage_keeps_one_leaf_per_cluster() -> None:
    siblings = [["r"], ["r"], ["r"], ["r"]]
    rewards = [1.0, 0.95, 0.9, 0.2]
    clusters = [0, 0, 0, 1]
    # O = rebase widths / 8 = [3, 3, 2, 0] / 8 at T = 0.2: leaf 3's outcome is 0, its node costs 1/5
    assert ets_retain(rewards, siblings, clusters, 8, lambda_kv=1.0, lambda_cov=0.0) == [True, True, True, False]
    # covering cluster 1 is worth 1.4 / 2 > 1/5
    assert ets_retain(rewards, siblings, clusters, 8, lambda_kv=1.0, lambda_cov=1.4) == [True, True, True, True]


def test_coverage_against_a_large_kv_cost_keeps_exactly_one_leaf_per_cluster() -> None:
    siblings = [["r"]] * 4
    rewards = [0.6, 0.9, 0.3, 0.5]
    keep = ets_retain(rewards, siblings, [0, 0, 1, 1], 8, temperature=1.0, lambda_kv=2.0, lambda_cov=3.0)
    assert keep == [False, True, False, True]  # the best leaf of each cluster
    widths = ets_select(rewards, siblings, [0, 0, 1, 1], 8, temperature=1.0, lambda_kv=2.0, lambda_cov=3.0)
    assert widths[0] == widths[2] == 0 and widths[1] > 0 and widths[3] > 0 and sum(widths) == 8


def test_selection_edge_cases() -> None:
    assert ets_select([], [], [], 8) == []
    assert ets_select([0.5, 0.7], [["r"], ["r"]], [0, 1], 0) == [0, 0]
    assert ets_select([0.5], [[]], [0], 5) == [5]
    with pytest.raises(ValueError, match="one ancestor path and one cluster per leaf"):
        ets_select([0.5, 0.7], [["r"]], [0, 1], 4)
    with pytest.raises(ValueError, match="lambda"):
        ets_select([0.5], [["r"]], [0], 4, lambda_kv=-1.0)


def test_widths_always_sum_to_the_budget() -> None:
    rewards = [0.1 * i for i in range(10)]
    paths = [["r", f"p{i % 3}", f"q{i % 5}"] for i in range(10)]
    clusters = [i % 4 for i in range(10)]
    for budget in (1, 7, 32):
        widths = ets_select(rewards, paths, clusters, budget)
        assert sum(widths) == budget and all(w >= 0 for w in widths)


def test_identical_texts_merge_and_different_ones_do_not() -> None:
    texts = [
        "Factor the quadratic: (x - 2)(x - 3).",
        "factor the   quadratic: (x - 2)(x - 3).",
        "Apply the quadratic formula with a = 1, b = -5, c = 6.",
        "Factor the quadratic: (x - 2)(x - 3).",
    ]
    assert semantic_clusters(texts, threshold=0.0) == [0, 0, 1, 0]  # case and spacing do not matter
    assert semantic_clusters(texts, threshold=0.3) == [0, 0, 1, 0]
    assert semantic_clusters(texts, threshold=1.0) == [0, 0, 0, 0]  # a cut above every distance merges all


def test_near_duplicates_merge_under_a_loose_cut_only() -> None:
    texts = ["The sum of the roots is 2 + 3 = 5.", "The sum of the roots is 2 + 3 = 5, so the answer is 5."]
    assert semantic_clusters(texts, threshold=0.05) == [0, 1]
    assert semantic_clusters(texts, threshold=0.6) == [0, 0]


def test_clusters_are_deterministic_and_handle_empty_texts() -> None:
    texts = ["", "x = 4", "  ", "y = 7 so x = 4"]
    first = semantic_clusters(texts, threshold=0.2)
    assert first == semantic_clusters(list(texts), threshold=0.2)
    assert first[0] == first[2] and first[0] != first[1]
    assert semantic_clusters([], 0.1) == [] and semantic_clusters(["one"], 0.1) == [0]


def test_clusters_follow_the_embedder_given() -> None:
    """With an embedder the cut is on its cosine distances, not the trigrams': two texts that share no trigram
    but embed alike merge, and two near-identical texts that embed apart do not."""
    vectors = {"two plus three": [1.0, 0.0], "five": [0.99, 0.141], "x = 4": [0.0, 1.0], "x = 5": [0.6, 0.8]}

    def embed(texts):
        rows = np.array([vectors[t] for t in texts])
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)

    texts = list(vectors)
    assert semantic_clusters(texts, threshold=0.05, embed=embed) == [0, 0, 1, 2]
    assert semantic_clusters(texts, threshold=0.6) != [0, 0, 1, 2]  # the trigram stand-in sees other clusters
    with pytest.raises(ValueError, match="gave 1 vectors for 4 texts"):
        semantic_clusters(texts, threshold=0.05, embed=lambda t: np.ones((1, 2)))


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory) -> str:
    """A random tiny BERT with the tests' word-level tokenizer, saved as a checkpoint folder."""
    import torch
    from transformers import BertConfig, BertModel

    from conftest import build_tiny_tokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-bert")
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    BertModel(config).save_pretrained(path)
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = "<unk>"
    tokenizer.save_pretrained(path)
    return str(path)


def test_an_encoder_checkpoint_embeds_texts_as_unit_vectors_whatever_the_batch(tiny_encoder) -> None:
    from spectot.models.embedder import load_embedder

    embed = load_embedder(tiny_encoder, batch_size=4)
    texts = ["w1 w2 w3", "w1 w2 w3", "w40 w41", "w7 w8 w9 w10 w11 w12 w13", "w5"]
    vectors = embed(texts)
    assert vectors.shape == (5, 32)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    alone = np.vstack([embed([t]) for t in texts])  # no padding: each text its own batch
    assert np.allclose(vectors, alone, atol=1e-5)  # padded rows are masked out of the mean
    assert np.allclose(vectors[0], vectors[1])
    assert semantic_clusters(texts, 1e-6, embed)[:2] == [0, 0]
    assert len(set(semantic_clusters(texts, 1e-6, embed))) == 4


def test_a_decoder_checkpoint_embeds_too_and_bad_names_are_refused(tiny_checkpoint, tmp_path) -> None:
    from spectot.models.embedder import load_embedder
    from spectot.models.loader import ModelLoadError

    vectors = load_embedder(str(tiny_checkpoint))(["w1 w2", "w3"])
    assert vectors.shape[0] == 2 and np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    # a batch of empty texts tokenises to no columns (the model refused the (b, 0) input): zero vectors
    empty = load_embedder(str(tiny_checkpoint), batch_size=2)(["w1", "w2", "", ""])
    assert np.allclose(np.linalg.norm(empty, axis=1), [1, 1, 0, 0])
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_embedder("not-a-model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot load an embedder"):
        load_embedder(str(tmp_path))
