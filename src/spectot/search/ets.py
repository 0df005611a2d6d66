"""ETS, efficient tree search (Hooper et al. 2025, "ETS: Efficient Tree Search for Inference-Time Scaling",
arXiv 2502.13575): REBASE whose per-depth selection first solves an integer linear program that trades the
REBASE reward allocation against the KV cache the retained tree costs and the semantic coverage it keeps.

Owns the selection ILP (``ets_retain``), the widths it leads to (``ets_select``) and the step clustering that
feeds its coverage term (``semantic_clusters``). Following the paper and the authors' code (``rebase.py``,
``select_softmax_costmodel``), for N open leaves and the M distinct tree nodes above them:

    max_{x, y, c}   sum_i O_i x_i  -  lambda_kv * C * (sum_j y_j + sum_i x_i)  +  (lambda_cov / K) * sum_k c_k
    s.t.            y_j >= x_i          for every leaf i below node j      # a kept leaf keeps its whole path
                    y_j <= sum_i x_i    over the leaves below node j       # a node with no kept leaf is freed
                    c_k <= sum_i x_i    over the leaves in cluster k       # cluster k is covered by a kept leaf
                    sum_i x_i >= 1                                          # never prune everything
                    x, y, c binary

    x_i: keep leaf i       y_j: keep (the KV of) ancestor node j      c_k: semantic cluster k is covered
    O_i = W_i / B with W = REBASE widths of all N leaves (softmax(R / T_b), T_b = 0.2)
    C   = 1 / (M + N): the per-node KV cost, uniform (every retained node, shared ancestors counted once)
    K   = number of clusters (the coverage term is scaled by 1 / K)

The kept leaves then split the budget REBASE-style among themselves: W' = round(B softmax(R_kept / T_b)), pruned
leaves get 0. Defaults are the authors' MATH-500 settings: lambda_kv (their lambda_c) = 1.0, lambda_cov (their
lambda_s) = 1.4 at width 64 (1.5 at 16, 1.45 at 256). As in their code, lambda_kv = 0 turns the node term into a
tiny bonus (1e-4 per node), so ties keep every leaf and lambda_kv = lambda_cov = 0 is exactly REBASE.

Worked example (B = 8, T_b = 0.2, lambda_kv = 1.5, lambda_cov = 0): leaves a1, a2 under node a, b1 under b,
c1 under c, all under root r, equal rewards. O = [1/4] * 4, C = 1/8 (M = 4: r, a, b, c; N = 4). Keeping a1
costs 3 nodes (r, a, a1); a2 then adds 1/4 - 1.5/8 > 0 (it shares r and a); b1 would add 1/4 - 2 * 1.5/8 < 0.
So a1 and a2 are kept and the widths are [4, 4, 0, 0] (REBASE: [2, 2, 2, 2]).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array
from scipy.spatial.distance import squareform

from spectot.search.rebase import rebase_widths


class EtsSolverError(RuntimeError):
    """The selection ILP had no solution (HiGHS reported a failure)."""


def ets_retain(
    rewards: Sequence[float],
    ancestors: Sequence[Sequence[Hashable]],
    clusters: Sequence[Hashable],
    budget: int,
    temperature: float = 0.2,
    lambda_kv: float = 1.0,
    lambda_cov: float = 1.4,
) -> list[bool]:
    """x: which leaves the ETS ILP keeps. ancestors[i]: leaf i's proper ancestors' ids; clusters[i]: its cluster."""
    n = len(rewards)
    if len(ancestors) != n or len(clusters) != n:
        raise ValueError(
            f"one ancestor path and one cluster per leaf: got {n} rewards, {len(ancestors)} paths, "
            f"{len(clusters)} clusters"
        )
    if budget < 1:
        raise ValueError(f"budget B must be >= 1 to choose leaves, got {budget}")
    if lambda_kv < 0 or lambda_cov < 0:
        raise ValueError(f"lambda_kv and lambda_cov must be >= 0, got {lambda_kv} and {lambda_cov}")
    if n == 0:
        return []

    nodes = {v: j for j, v in enumerate(dict.fromkeys(v for path in ancestors for v in path))}  # y_j index
    groups = {k: g for g, k in enumerate(dict.fromkeys(clusters))}  # c_k index
    m, n_clusters = len(nodes), len(groups)
    x_at, y_at, c_at = 0, n, n + m  # variable layout: [x_0..x_{N-1}, y_0..y_{M-1}, c_0..c_{K-1}]

    outcome = np.asarray(rebase_widths(rewards, budget, temperature), dtype=np.float64) / budget  # O_i = W_i / B
    node_cost = 1.0 / (m + n)  # C = 1 / (M + N)
    kv_coef = -lambda_kv if lambda_kv > 0 else 1e-4  # the authors' guard: lambda_kv = 0 -> tiny keep bonus
    gain = np.concatenate(
        [
            outcome + kv_coef * node_cost,  # O_i x_i - lambda_kv C x_i
            np.full(m, kv_coef * node_cost),  # - lambda_kv C y_j
            np.full(n_clusters, lambda_cov / n_clusters),  # + (lambda_cov / K) c_k
        ]
    )

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def add_row(terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(lower)
        for col, val in terms:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    below: dict[int, list[int]] = {j: [] for j in range(m)}  # node j -> the leaves under it
    for i, path in enumerate(ancestors):
        for j in sorted({nodes[v] for v in path}):
            below[j].append(i)
            add_row([(y_at + j, 1.0), (x_at + i, -1.0)], 0.0, np.inf)  # y_j >= x_i
    for j, leaves in below.items():
        add_row([(y_at + j, 1.0)] + [(x_at + i, -1.0) for i in leaves], -np.inf, 0.0)  # y_j <= sum x_i
    members: dict[int, list[int]] = {g: [] for g in range(n_clusters)}
    for i, k in enumerate(clusters):
        members[groups[k]].append(i)
    for g, leaves in members.items():
        add_row([(c_at + g, 1.0)] + [(x_at + i, -1.0) for i in leaves], -np.inf, 0.0)  # c_k <= sum x_i
    add_row([(x_at + i, 1.0) for i in range(n)], 1.0, np.inf)  # sum x_i >= 1

    size = n + m + n_clusters
    matrix = coo_array((vals, (rows, cols)), shape=(len(lower), size)).tocsr()
    result = milp(
        -gain,  # milp minimises
        constraints=LinearConstraint(matrix, lower, upper),
        integrality=np.ones(size),
        bounds=Bounds(0.0, 1.0),
        options={"mip_rel_gap": 0.0},  # the exact optimum: the keep-bonus tie-break is far below HiGHS's default gap
    )
    if not result.success or result.x is None:
        raise EtsSolverError(
            f"ETS selection ILP failed (HiGHS status {result.status}: {result.message}) for {n} leaves, "
            f"{m} ancestor nodes, {n_clusters} clusters; check that rewards are finite and lambdas are reasonable"
        )
    return [bool(v > 0.5) for v in result.x[x_at : x_at + n]]


def ets_select(
    rewards: Sequence[float],
    ancestors: Sequence[Sequence[Hashable]],
    clusters: Sequence[Hashable],
    budget: int,
    temperature: float = 0.2,
    lambda_kv: float = 1.0,
    lambda_cov: float = 1.4,
) -> list[int]:
    """Children per leaf, summing to B: REBASE widths over the leaves the ETS ILP keeps, 0 for pruned ones."""
    if budget < 0:
        raise ValueError(f"budget B must be >= 0, got {budget}")
    if budget == 0:
        return [0] * len(rewards)
    keep = ets_retain(rewards, ancestors, clusters, budget, temperature, lambda_kv, lambda_cov)
    kept = [i for i, k in enumerate(keep) if k]
    kept_widths = rebase_widths([rewards[i] for i in kept], budget, temperature)  # W' = round(B softmax(R_kept/T_b))
    widths = [0] * len(rewards)
    for i, w in zip(kept, kept_widths):
        widths[i] = w
    return widths


# -- semantic clusters ---------------------------------------------------------------------------------------------
def char_ngram_tfidf(texts: Sequence[str], n: int = 3) -> np.ndarray:
    """(T, V) L2-normalised TF-IDF of each text's character n-grams within words (words padded with spaces)."""
    grams_per_text = []
    for text in texts:
        grams: dict[str, int] = {}
        for word in text.lower().split():
            padded = f" {word} "
            for s in range(max(len(padded) - n + 1, 1)):
                gram = padded[s : s + n]
                grams[gram] = grams.get(gram, 0) + 1
        grams_per_text.append(grams)
    vocab = {g: v for v, g in enumerate(sorted({g for grams in grams_per_text for g in grams}))}
    tf = np.zeros((len(texts), len(vocab)))  # (T, V) raw counts
    for t, grams in enumerate(grams_per_text):
        for gram, count in grams.items():
            tf[t, vocab[gram]] = count
    df = (tf > 0).sum(axis=0)  # (V,) texts containing each gram
    idf = np.log((1 + len(texts)) / (1 + df)) + 1  # smoothed idf: a gram in every text still counts a little
    vectors = tf * idf
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)


Embed = Callable[[Sequence[str]], np.ndarray]  # texts -> (T, H) unit vectors


def semantic_clusters(texts: Sequence[str], threshold: float, embed: Embed | None = None) -> list[int]:
    """Cluster id per text (0, 1, ... in first-seen order): average linkage on cosine distance, cut at threshold.

    ``embed``: the paper's sentence embeddings (``models/embedder.py``; the authors cut at cosine distance 0.05
    on their math-BERT embeddings); None: TF-IDF of character trigrams, whose distances run larger (cut at ~0.6).
    Identical texts always merge; a text with no words (a zero vector) is at distance 1 from every other text
    and 0 from other empty ones.
    """
    if threshold < 0:
        raise ValueError(f"threshold is a cosine distance cut and must be >= 0, got {threshold}")
    if len(texts) <= 1:
        return [0] * len(texts)
    vectors = (embed or char_ngram_tfidf)(texts)  # (T, V), unit rows
    if vectors.shape[0] != len(texts):
        raise ValueError(f"the embedder gave {vectors.shape[0]} vectors for {len(texts)} texts")
    similarity = vectors @ vectors.T  # (T, T) cosine similarity of unit vectors
    empty = ~vectors.any(axis=1)
    similarity[np.ix_(empty, empty)] = 1.0  # empty texts are identical to each other
    distance = np.clip(1.0 - similarity, 0.0, 2.0)
    distance[np.abs(distance) < 1e-12] = 0.0  # identical texts: exactly 0, not 1e-16, so threshold 0 merges them
    np.fill_diagonal(distance, 0.0)
    tree = linkage(squareform(distance, checks=False), method="average")
    labels = fcluster(tree, threshold, criterion="distance")
    first_seen = {label: g for g, label in enumerate(dict.fromkeys(labels.tolist()))}
    return [first_seen[label] for label in labels.tolist()]
