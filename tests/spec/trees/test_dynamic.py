"""Dynamic draft-tree policies against trees worked out by hand, plus the invariants every policy keeps:
gap-free rank-ordered expansions, ancestor-closed finalized trees, node caps."""

from __future__ import annotations

import random

import pytest
import torch

from spectot.spec.trees.dynamic import (
    CAPEPolicy,
    EAGLE2Policy,
    PCTPolicy,
    StaticPolicy,
    VCTPolicy,
    bfs_order,
    check_expansion,
    grow,
    keep_most_confident,
    keep_subtree,
    prune_leaves,
    verified_tree_size,
)
from spectot.spec.trees.sequoia import expected_tokens, sequoia_tree
from spectot.spec.trees.shapes import k_config_tree, specinfer_tree
from spectot.spec.trees.sizing import TCurve

DOCSTRING_PROBS = {(): [0.6, 0.3], (0,): [0.9, 0.05], (1,): [0.5, 0.4]}


def table(probs: dict[tuple[int, ...], list[float]], default: list[float] | None = None):
    """child_probs_of from a dict of paths; paths not listed get ``default`` (or fail the test)."""

    def child_probs_of(path: tuple[int, ...]) -> torch.Tensor:
        if path not in probs and default is None:
            raise AssertionError(f"the policy asked for the children of {path}, which it should not expand")
        return torch.tensor(probs.get(path, default), dtype=torch.float64)

    return child_probs_of


def random_draft(seed: int, k: int):
    """A deterministic pseudo-draft: each path gets its own sorted probabilities (summing to < 1)."""

    def child_probs_of(path: tuple[int, ...]) -> torch.Tensor:
        rng = random.Random(hash((seed, path)))
        weights = sorted((rng.random() ** 3 for _ in range(k)), reverse=True)
        total = sum(weights) / rng.uniform(0.5, 0.99)
        return torch.tensor([w / total for w in weights], dtype=torch.float64)

    return child_probs_of


def ordered_form(parents: list[int], node: int = 0) -> tuple:
    """The ordered tree below ``node`` as nested tuples (children in index order): equal iff same shape."""
    return tuple(ordered_form(parents, c) for c in range(len(parents)) if parents[c] == node and c != node)


def is_ancestor_closed(parents: list[int], keep: list[int]) -> bool:
    kept = set(keep)
    return 0 in kept and all(parents[v] in kept for v in keep if v != 0)


# --- the module docstring's worked example ----------------------------------------------------------------


def test_docstring_example_eagle2() -> None:
    parents, conf = grow(EAGLE2Policy(top_k=2, depth=2, total_tokens=3), table(DOCSTRING_PROBS))
    assert parents == [-1, 0, 0, 1]
    assert conf == pytest.approx([1.0, 0.6, 0.3, 0.54])


def test_docstring_example_pct() -> None:
    policy = PCTPolicy(threshold=0.35, width=2, max_depth=2, leaf_threshold=0.05)
    parents, conf = grow(policy, table(DOCSTRING_PROBS))  # table() fails if b = (1,) is ever expanded
    assert parents == [-1, 0, 0, 1]
    assert conf == pytest.approx([1.0, 0.6, 0.3, 0.54])


# --- conventions ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pairs",
    [[(0, 1)], [(0, 0), (0, 2)], [(1, 0), (0, 0)], [(0, 0), (0, 0)], [(2, 0)], [(0, 0), (0, 1), (0, 2), (0, 3)]],
)
def test_check_expansion_refuses_gaps_disorder_and_foreign_rows(pairs) -> None:
    with pytest.raises(ValueError):
        check_expansion(pairs, rows=[0, 1], k=3)


def test_check_expansion_accepts_grouped_gap_free_pairs() -> None:
    check_expansion([(0, 0), (0, 1), (2, 0)], rows=[0, 2], k=2)
    check_expansion([], rows=[], k=1)


def test_grow_refuses_a_policy_that_breaks_the_conventions() -> None:
    class Gappy(VCTPolicy):
        def expand(self, depth, path_conf, child_probs):
            return [(0, 1)]

    with pytest.raises(ValueError):
        grow(Gappy(width=2, max_depth=1), table({(): [0.5, 0.3]}))


def test_bfs_order_renumbers_depth_first_shapes() -> None:
    assert bfs_order(specinfer_tree(2, 3)) == [-1, 0, 0, 1, 2, 3, 4]
    assert bfs_order(k_config_tree((2, 1))) == k_config_tree((2, 1))  # already breadth-first
    with pytest.raises(ValueError):
        bfs_order([0, 0])


def test_keep_subtree_renumbers_and_refuses_orphans() -> None:
    parents = [-1, 0, 0, 1, 2, 2]
    assert keep_subtree(parents, [0, 2, 4, 5]) == [-1, 0, 1, 1]
    with pytest.raises(ValueError):
        keep_subtree(parents, [0, 3])  # 3's parent 1 dropped
    with pytest.raises(ValueError):
        keep_subtree(parents, [1, 3])  # no root


POLICIES = [
    StaticPolicy(tuple(k_config_tree((3, 2, 1)))),
    PCTPolicy(threshold=0.02, width=3, max_depth=6, leaf_threshold=0.01, max_nodes=30),
    VCTPolicy(width=3, max_depth=5),
    CAPEPolicy(),
    CAPEPolicy(chain=False, max_depth=3, max_nodes=40),
    EAGLE2Policy(top_k=4, depth=4, total_tokens=20),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("seed", range(5))
def test_every_policy_grows_a_valid_capped_tree(policy, seed: int) -> None:
    """grow itself checks every expansion (gap-free, grouped) and that finalize is ancestor-closed."""
    parents, conf = grow(policy, random_draft(seed, policy.max_children))
    assert bfs_order(parents) == parents  # breadth-first, siblings in rank order
    assert len(conf) == len(parents) and conf[0] == 1.0
    assert all(conf[v] <= conf[parents[v]] for v in range(1, len(parents)))
    assert max(_depths(parents)) <= policy.max_depth
    assert len(parents) <= {"PCTPolicy": 30, "VCTPolicy": 40, "CAPEPolicy": 40, "EAGLE2Policy": 21}.get(
        type(policy).__name__, 64
    )


# --- StaticPolicy -----------------------------------------------------------------------------------------


def test_static_reproduces_k_config_with_sequoia_path_confidences() -> None:
    shape = k_config_tree((2, 2, 1))
    acceptance = [0.6, 0.25]
    parents, conf = grow(StaticPolicy(tuple(shape)), table({}, default=acceptance))
    assert parents == shape
    assert sum(conf) == pytest.approx(expected_tokens(shape, acceptance))
    assert conf[:3] == pytest.approx([1.0, 0.6, 0.25])


def test_static_reproduces_a_sequoia_tree() -> None:
    acceptance = [0.55, 0.2, 0.1, 0.05]
    tree = sequoia_tree(acceptance, budget=24, max_depth=6)
    policy = StaticPolicy(tuple(tree.parents))
    parents, conf = grow(policy, table({}, default=acceptance))
    assert parents == bfs_order(tree.parents) == list(policy.shape)
    assert ordered_form(parents) == ordered_form(tree.parents)
    assert sum(conf) == pytest.approx(tree.expected_tokens)


def test_static_reads_only_rows_with_children_and_refuses_a_foreign_frontier() -> None:
    policy = StaticPolicy((-1, 0, 0, 1))
    assert policy.frontier_to_expand(2, torch.ones(2)) == [0]
    assert policy.expand(2, torch.ones(2), torch.ones(2, 2)) == [(0, 0)]
    assert policy.expand(3, torch.ones(1), torch.ones(1, 2)) == []
    with pytest.raises(ValueError):
        policy.expand(2, torch.ones(3), torch.ones(3, 2))


# --- PCTPolicy --------------------------------------------------------------------------------------------


def test_pct_stops_expanding_below_threshold() -> None:
    # chain of 0.7s: f = 1, .7, .49, .343; threshold .4 expands r, .7, .49 and stops at .343 (< max_depth 8)
    policy = PCTPolicy(threshold=0.4, width=1)
    parents, conf = grow(policy, table({}, default=[0.7]))
    assert parents == [-1, 0, 1, 2]
    assert conf == pytest.approx([1.0, 0.7, 0.49, 0.343])
    assert policy.frontier_to_expand(4, torch.tensor([0.343])) == []
    assert policy.expand(4, torch.tensor([0.343]), torch.tensor([[0.7]])) == []


def test_pct_expands_each_node_above_threshold_by_width() -> None:
    policy = PCTPolicy(threshold=0.2, width=2)
    pairs = policy.expand(2, torch.tensor([0.5, 0.1, 0.2]), torch.tensor([[0.6, 0.3], [0.9, 0.1], [0.5, 0.5]]))
    assert pairs == [(0, 0), (0, 1), (2, 0), (2, 1)]


def test_verified_tree_size_against_the_docstring_table() -> None:
    t = TCurve(((1, 1.0), (2, 1.05), (3, 1.1), (4, 1.2), (5, 1.6)))
    assert verified_tree_size([0.8, 0.6, 0.3, 0.1], t) == 3  # ratios 1, 1.71, 2.18, 2.25, 1.75
    assert verified_tree_size([0.8, 0.6, 0.3, 0.1], TCurve(((1, 1.0),))) == 4  # flat t: every node pays
    assert verified_tree_size([0.05], TCurve(((1, 1.0), (2, 2.0)))) == 0  # a row costs a step: draft nothing


def test_pct_verifies_only_the_tree_size_this_machine_pays_for() -> None:
    parents, conf = [-1, 0, 0, 1, 1, 2], [1.0, 0.8, 0.3, 0.6, 0.1, 0.2]  # f of the non-root: .8 .6 .3 .2 .1
    t = TCurve(((1, 1.0), (2, 1.05), (3, 1.1), (4, 1.2), (5, 1.6)))  # n* = 3: keep .8, .6, .3
    assert PCTPolicy(threshold=0.1).finalize(parents, conf) == [0, 1, 2, 3, 4, 5]
    assert PCTPolicy(threshold=0.1, verify_cost=t).finalize(parents, conf) == [0, 1, 2, 3]
    assert PCTPolicy(threshold=0.1, verify_cost=t, max_nodes=3).finalize(parents, conf) == [0, 1, 3]


def test_pct_leaf_pruning_is_repeated_and_spares_the_root() -> None:
    parents = [-1, 0, 1, 0]  # 0 -> 1 -> 2, 0 -> 3
    assert prune_leaves(parents, [1.0, 0.2, 0.1, 0.5], 0.3) == [0, 3]  # 2 goes, then 1 (now a leaf)
    assert prune_leaves(parents, [1.0, 0.2, 0.4, 0.5], 0.3) == [0, 1, 2, 3]  # 1 keeps its confident child
    assert PCTPolicy(threshold=0.0, leaf_threshold=2.0).finalize(parents, [1.0, 0.9, 0.8, 0.7]) == [0]


def test_pct_max_nodes_keeps_the_most_confident_children() -> None:
    # depth 1: a .6, b .4; depth 2 candidates a0 .3, a1 .3, b0 .36, b1 .04 -> per-depth cap 3 keeps a0 a1 b0;
    # finalize caps the tree at 4 nodes: r, a .6, b .4, b0 .36
    policy = PCTPolicy(threshold=0.0, width=2, max_depth=2, max_nodes=4)
    pairs = policy.expand(2, torch.tensor([0.6, 0.4]), torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    assert pairs == [(0, 0), (0, 1), (1, 0)]
    parents, conf = grow(policy, table({(): [0.6, 0.4], (0,): [0.5, 0.5], (1,): [0.9, 0.1]}))
    assert parents == [-1, 0, 0, 2]
    assert conf == pytest.approx([1.0, 0.6, 0.4, 0.36])


def test_pct_cap_prefers_confident_children_of_later_rows() -> None:
    # f(child): row 0 -> .2, .15; row 1 -> .45, .025; a cap of 2 keeps .45 and .2
    policy = PCTPolicy(threshold=0.0, width=2, max_nodes=3)
    pairs = policy.expand(2, torch.tensor([0.5, 0.5]), torch.tensor([[0.4, 0.3], [0.9, 0.05]]))
    assert pairs == [(0, 0), (1, 0)]


def test_pct_refuses_negative_thresholds() -> None:
    with pytest.raises(ValueError):
        PCTPolicy(threshold=-0.1)
    with pytest.raises(ValueError):
        PCTPolicy(threshold=0.1, width=0)


# --- VCTPolicy --------------------------------------------------------------------------------------------


def test_vct_expands_the_width_most_confident_frontier_nodes() -> None:
    # width 2: depth 1 r -> a .6, b .3; depth 2 a -> .54 .03, b -> .15 .12; depth 3 expands the two best
    # frontier nodes (.54 and .15; not .03 or .12)
    probs = {**DOCSTRING_PROBS, (0, 0): [0.5, 0.5], (1, 0): [0.8, 0.2]}
    parents, conf = grow(VCTPolicy(width=2, max_depth=3), table(probs))
    assert parents == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 5, 5]
    assert conf == pytest.approx([1, 0.6, 0.3, 0.54, 0.03, 0.15, 0.12, 0.27, 0.27, 0.12, 0.03])


def test_vct_default_size_is_sane() -> None:
    parents, _ = grow(VCTPolicy(), random_draft(0, 3))
    assert len(parents) == 1 + 3 + 4 * 9


# --- CAPEPolicy -------------------------------------------------------------------------------------------


def test_cape_buckets_match_the_reference_decile_table() -> None:
    deciles = [8, 8, 8, 6, 6, 6, 4, 4, 2, 2, 2]  # released GliDe/CaPE benchmark, indexed by int(top1 * 10)
    policy = CAPEPolicy()
    for i in range(101):
        top1 = i / 100
        assert policy.width_for(top1) == deciles[int(top1 * 10)], top1


def test_cape_chain_widens_by_confidence_and_continues_only_the_greedy_token() -> None:
    # top-1 along the greedy chain: .9 -> 2 candidates, .5 -> 6, .2 -> 8, .7 -> 4
    probs = {
        (): [0.9, 0.05],
        (0,): [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
        (0, 0): [0.2] + [0.1] * 7,
        (0, 0, 0): [0.7, 0.1, 0.1, 0.1],
    }
    parents, conf = grow(CAPEPolicy(), table(probs))  # table() fails if an alternative is ever expanded
    assert parents == [-1, 0, 0] + [1] * 6 + [3] * 8 + [9] * 4
    assert conf[9] == pytest.approx(0.9 * 0.5 * 0.2)
    assert CAPEPolicy().frontier_to_expand(2, torch.tensor([0.9, 0.05])) == [0]


def test_cape_tree_mode_widens_every_frontier_node() -> None:
    # r (top1 .5) -> 6 children; each child's top1 decides its own width: .9 -> 2, .65 -> 4, rest .1 -> 8
    widths_by_top1 = {0: [0.9, 0.1], 1: [0.65, 0.2, 0.1, 0.05]}
    probs = {(): [0.5] + [0.1] * 5}
    for rank in range(6):
        probs[(rank,)] = widths_by_top1.get(rank, [0.1] * 8)
    policy = CAPEPolicy(chain=False, max_depth=2, max_nodes=1000)
    parents, _ = grow(policy, table(probs))
    assert parents == [-1] + [0] * 6 + [1] * 2 + [2] * 4 + [3] * 8 + [4] * 8 + [5] * 8 + [6] * 8


def test_cape_refuses_buckets_that_leave_confidences_without_a_width() -> None:
    with pytest.raises(ValueError):
        CAPEPolicy(buckets=((0.8, 2), (0.3, 6)))
    with pytest.raises(ValueError):
        CAPEPolicy(buckets=((0.3, 2), (0.8, 6), (0.0, 8)))


# --- EAGLE2Policy -----------------------------------------------------------------------------------------


def test_eagle2_expands_the_top_k_frontier_nodes_by_top_k_children() -> None:
    policy = EAGLE2Policy(top_k=2, depth=3, total_tokens=10)
    pairs = policy.expand(3, torch.tensor([0.1, 0.5, 0.3, 0.2]), torch.full((4, 2), 0.4))
    assert pairs == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert policy.expand(4, torch.tensor([0.1]), torch.full((1, 2), 0.4)) == []


@pytest.mark.parametrize("seed", range(8))
def test_eagle2_rerank_keeps_exactly_total_tokens_most_confident_closed(seed: int) -> None:
    policy = EAGLE2Policy(top_k=3, depth=5, total_tokens=15)
    parents, conf = grow(EAGLE2Policy(top_k=3, depth=5, total_tokens=10**6), random_draft(seed, 3))  # unpruned
    keep = policy.finalize(parents, conf)
    assert len(keep) == 15 + 1
    assert is_ancestor_closed(parents, keep)
    dropped = [conf[v] for v in range(len(parents)) if v not in keep]
    assert min(conf[v] for v in keep) >= max(dropped)


def test_eagle2_rerank_ties_prefer_shallow_nodes_and_stay_closed() -> None:
    parents = [-1, 0, 0, 1, 1, 2, 2]  # every f equal: the tie-break alone must give closure
    conf = [1.0] * 7
    assert keep_most_confident(parents, conf, 3) == [0, 1, 2, 3]
    # f rising along a path (not a real draft, but a caller may pass it): still closed
    assert keep_most_confident(parents, [1.0, 0.1, 0.2, 0.9, 0.8, 0.05, 0.05], 2) == [0, 1, 2]


def test_eagle2_keeps_everything_when_the_tree_is_small() -> None:
    parents, conf = grow(EAGLE2Policy(top_k=2, depth=2, total_tokens=60), table(DOCSTRING_PROBS))
    assert parents == [-1, 0, 0, 1, 1, 2, 2]
    assert conf == pytest.approx([1, 0.6, 0.3, 0.54, 0.03, 0.15, 0.12])


def _depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for v in range(1, len(parents)):
        depth[v] = depth[parents[v]] + 1
    return depth


def test_pct_prices_its_tree_for_the_streams_sharing_the_forward() -> None:
    """B streams' trees share one forward of B m rows: at 8 % a row (a CPU), one stream keeps 5 nodes of these
    confidences, eight streams keep 2 (priced alone, each kept 5: ~17 % slower than the best at B = 8)."""
    curve = TCurve(((1, 1.0), (256, 1.0 + 0.08 * 255)))
    conf = [0.9, 0.7, 0.5, 0.35, 0.25, 0.12, 0.08]
    policy = PCTPolicy(threshold=0.05, verify_cost=curve)
    assert policy.for_streams(1) is policy
    alone = verified_tree_size(conf, policy.verify_cost)
    shared = verified_tree_size(conf, policy.for_streams(8).verify_cost)
    assert (alone, shared) == (5, 2)
    assert policy.for_streams(8).verify_cost(1) == 1.0  # relative to the B rows of plain decoding
