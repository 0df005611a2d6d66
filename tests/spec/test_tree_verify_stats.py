"""Statistical losslessness of tree verification on synthetic p, q (complements test_tree_verify.py):
every stochastic rule, 1-4 children, several temperatures, truncated targets and drafts; the joint law
of the first two emitted tokens of a depth-2 tree with node-dependent p, q; acceptance identities
(one child: 1 - TV; several children: the residual chain; deterministic and naive: target mass of
the children); an exhausted draft without replacement; p == q.

Children are drawn afresh for every trial (losslessness holds over the draft's randomness too),
except for the deterministic rule, whose children are fixed tokens.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spectot.engine.token_tree import TokenTree
from spectot.spec.tree_verify import TreeVerdict, verify_tree

STOCHASTIC_RULES = ["with_replacement", "without_replacement", "deterministic", "naive"]
TEMPERATURES = [0.5, 1.0, 2.0]
P_VALUE = 1e-3


# ---- synthetic distributions and drafts ------------------------------------------------------------


def synthetic_pair(vocab: int, temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p, q = softmax(logits / T) of correlated random logits. At T = 0.5 the target is top-k
    truncated (its least likely token gets exactly 0); at T = 2 the draft misses a token (q = 0 there
    while p > 0), so only the residual can emit it."""
    gen = torch.Generator().manual_seed(seed)
    logits_p = 1.5 * torch.randn(vocab, generator=gen)
    logits_q = 0.7 * logits_p + torch.randn(vocab, generator=gen)
    p, q = (logits_p / temperature).softmax(-1), (logits_q / temperature).softmax(-1)
    if temperature == 0.5:
        p = p.index_fill(0, p.argmin().view(1), 0.0)
        p = p / p.sum()
    if temperature == 2.0:
        q = q.index_fill(0, q.argmin().view(1), 0.0)
        q = q / q.sum()
    return p, q


def draw_children(q: torch.Tensor, k: int, rule: str, trials: int, gen: torch.Generator) -> torch.Tensor:
    """(trials, k) children per trial, drawn the way ``rule`` assumes; q: (V,) or (trials, V)."""
    q = q.expand(trials, -1) if q.dim() == 1 else q
    if rule == "with_replacement":
        return torch.multinomial(q, k, replacement=True, generator=gen)
    if rule == "without_replacement":
        # exponential race: the k first arrivals of clocks with rates q are k sequential draws
        # without replacement; exact while at least k tokens have q > 0
        assert bool(((q > 0).sum(-1) >= k).all())
        return (q / torch.empty_like(q).exponential_(generator=gen)).topk(k, dim=-1).indices
    if rule == "deterministic":
        return q.topk(k, dim=-1).indices
    # naive accepts any children: uniform with replacement (duplicates, tokens with p = 0)
    return torch.randint(q.shape[-1], (trials, k), generator=gen)


def sequential_without_replacement(q: torch.Tensor, k: int, trials: int, gen: torch.Generator) -> torch.Tensor:
    """(trials, k) draws without replacement from q, uniform over the tokens not yet drawn once q
    is exhausted (the verifier tries such children as fixed candidates: exact whatever picked them)."""
    left = q.expand(trials, -1).clone()
    drawn = torch.zeros_like(left, dtype=torch.bool)
    picks = []
    for _ in range(k):
        exhausted = left.sum(-1, keepdim=True) <= 0
        left = torch.where(exhausted, (~drawn).float(), left)
        x = torch.multinomial(left, 1, generator=gen)  # (trials, 1)
        picks.append(x)
        drawn.scatter_(1, x, True)
        left = left.masked_fill(drawn, 0.0)
    return torch.cat(picks, dim=1)


class StarTrees:
    """Root plus k children, one TokenTree per distinct children tuple (building one costs as much
    as verifying it)."""

    def __init__(self, root: int, k: int) -> None:
        self.root, self.parents, self.cache = root, torch.tensor([-1] + [0] * k), {}

    def __call__(self, children: tuple[int, ...]) -> TokenTree:
        if children not in self.cache:
            self.cache[children] = TokenTree(torch.tensor([self.root, *children]), self.parents)
        return self.cache[children]


def first_emitted(tree: TokenTree, verdict: TreeVerdict) -> int:
    return int(tree.tokens[verdict.path[1]]) if len(verdict.path) > 1 else verdict.next_token


def first_token_counts(
    p: torch.Tensor, q: torch.Tensor, children: torch.Tensor, rule: str, gen: torch.Generator
) -> torch.Tensor:
    """Verify a star tree (root, children[t]) per trial with the same p, q at every node. The
    deterministic rule gets q too: it must treat its children as one-hot drafts whatever q says."""
    trials, k = children.shape
    trees = StarTrees(root=0, k=k)
    p_rows, q_rows = p.expand(k + 1, -1), q.expand(k + 1, -1)
    counts = torch.zeros(p.numel())
    for row in children.tolist():
        tree = trees(tuple(row))
        counts[first_emitted(tree, verify_tree(tree, p_rows, q_rows, rule, gen))] += 1
    return counts


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Counts over any table are a sample of ``probs``: no mass where probs == 0, chi-square (cells
    with expected count < 5 pooled) above P_VALUE, and total variation within sqrt(cells / n), about
    2.5 times its expected sampling value."""
    counts = counts.double().flatten().numpy()
    probs = probs.double().flatten().numpy()
    probs = probs / probs.sum()
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "emitted a token the target gives probability 0"
    expected = probs * n
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    f_obs = np.append(counts[big], counts[small].sum()) if small.any() else counts[big]
    f_exp = np.append(expected[big], expected[small].sum()) if small.any() else expected[big]
    assert chisquare(f_obs, f_exp).pvalue > P_VALUE
    tv = 0.5 * np.abs(counts / n - probs).sum()
    assert tv < math.sqrt((probs > 0).sum() / n)


def assert_rate(hits: int, trials: int, expected: float) -> None:
    """A Monte Carlo rate within 4 standard errors of the exact one."""
    se = math.sqrt(max(expected * (1 - expected), 1e-12) / trials)
    assert abs(hits / trials - expected) < 4 * se + 1e-9


# ---- 1. one level: the first emitted token follows p --------------------------------------------------

# (rule, k, T): every rule meets every temperature across its k, and every k several temperatures
CASES = [(rule, k, TEMPERATURES[(r + k) % 3]) for r, rule in enumerate(STOCHASTIC_RULES) for k in (1, 2, 3, 4)]
TRIALS = {"with_replacement": 6_000, "without_replacement": 6_000, "deterministic": 4_000, "naive": 8_000}


@pytest.mark.parametrize("rule,k,temperature", CASES)
def test_first_emitted_token_follows_the_target(rule: str, k: int, temperature: float) -> None:
    vocab = 4 + k  # 5..8
    p, q = synthetic_pair(vocab, temperature, seed=31 * k + STOCHASTIC_RULES.index(rule))
    gen = torch.Generator().manual_seed(1_000 + 10 * k + STOCHASTIC_RULES.index(rule))
    trials = TRIALS[rule]
    children = draw_children(q, k, rule, trials, gen)
    assert_follows(first_token_counts(p, q, children, rule, gen), p)


def test_deterministic_arbitrary_children_with_a_duplicate_and_an_impossible_token() -> None:
    p, _ = synthetic_pair(6, 0.5, seed=4)  # truncated: one token has p == 0
    impossible = int((p == 0).nonzero()[0])
    likely = int(p.argmax())
    children = torch.tensor([[impossible, likely, likely, (likely + 1) % 6]]).expand(3_000, -1)
    gen = torch.Generator().manual_seed(5)
    assert_follows(first_token_counts(p, torch.full((6,), 1 / 6), children, "deterministic", gen), p)


# ---- 2. two levels: the joint law of the first two emitted tokens -----------------------------------


@pytest.mark.parametrize("rule", STOCHASTIC_RULES)
def test_first_two_emitted_tokens_follow_the_target_chain(rule: str) -> None:
    """Root -> k1 children drawn from q_root -> k2 children each, drawn from Q2[child token]. p at a
    child is P2[its token], so the first two tokens must follow p_root(x1) * P2[x1, x2]; when no
    child is accepted the decoder's next step samples x2 from P2[x1], and so does the test."""
    vocab, k1, k2, trials = 5, 2, 2, 5_000
    gen = torch.Generator().manual_seed(60 + STOCHASTIC_RULES.index(rule))
    p_root, q_root = synthetic_pair(vocab, 1.0, seed=61)
    logits = 1.5 * torch.randn(vocab, vocab, generator=gen)
    P2 = logits.softmax(-1)  # (V, V): row x is the target after the child token x
    Q2 = (0.7 * logits + torch.randn(vocab, vocab, generator=gen)).softmax(-1)

    level1 = draw_children(q_root, k1, rule, trials, gen)  # (trials, k1)
    level2 = draw_children(Q2[level1.flatten()], k2, rule, trials * k1, gen).view(trials, k1 * k2)
    tokens = torch.cat([torch.zeros(trials, 1, dtype=torch.long), level1, level2], dim=1)
    parents = torch.tensor([-1] + [0] * k1 + [1 + i // k2 for i in range(k1 * k2)])  # BFS order
    trees = {}
    joint = torch.zeros(vocab, vocab)
    for row in tokens.tolist():
        key = tuple(row)
        if key not in trees:
            trees[key] = TokenTree(torch.tensor(row), parents)
        tree = trees[key]
        p = torch.cat([p_root.view(1, -1), P2[tree.tokens[1:]]])  # (n, V)
        q = None if rule == "deterministic" else torch.cat([q_root.view(1, -1), Q2[tree.tokens[1:]]])
        verdict = verify_tree(tree, p, q, rule, gen)
        emitted = tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token]
        if len(emitted) == 1:  # nothing accepted: the next decoding step samples after x1
            emitted.append(int(torch.multinomial(P2[emitted[0]], 1, generator=gen)))
        joint[emitted[0], emitted[1]] += 1
    assert_follows(joint, p_root[:, None] * P2)


# ---- 3. acceptance identities ----------------------------------------------------------------------


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 0 else p


def reject_all_with_replacement(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """P(k i.i.d. children from q are all rejected) = prod_i TV(p_i, q), p_{i+1} = residual(p_i, q)."""
    out = 1.0
    for _ in range(k):
        out *= 1.0 - np.minimum(p, q).sum()
        p = _residual(p, q)
    return out


def reject_all_without_replacement(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """Same for sequential draws without replacement: sum over the rejected token x of
    q(x) (1 - min(1, p(x) / q(x))) times the rejection law of what is left after removing x."""
    if k == 0:
        return 1.0
    out = 0.0
    for x in np.flatnonzero(q > 0):
        q_left = q.copy()
        q_left[x] = 0.0
        reject = q[x] - min(p[x], q[x])
        if reject > 0:
            out += reject * reject_all_without_replacement(_residual(p, q), q_left / q_left.sum(), k - 1)
    return out


@pytest.mark.parametrize("rule", ["with_replacement", "without_replacement"])
def test_one_child_is_accepted_with_the_overlap_of_p_and_q(rule: str) -> None:
    p, q = synthetic_pair(7, 1.0, seed=70)
    gen = torch.Generator().manual_seed(71)
    trials = 8_000
    tree_of = StarTrees(root=0, k=1)
    rows_p, rows_q = p.expand(2, -1), q.expand(2, -1)
    accepted = 0
    for (x,) in draw_children(q, 1, rule, trials, gen).tolist():
        accepted += verify_tree(tree_of((x,)), rows_p, rows_q, rule, gen).num_accepted
    assert_rate(accepted, trials, float(torch.minimum(p, q).sum()))  # = 1 - TV(p, q)


@pytest.mark.parametrize("rule", ["with_replacement", "without_replacement"])
def test_several_children_reject_all_with_the_residual_chain_probability(rule: str) -> None:
    # peaked, truncated p: with and without replacement reject all with very different probabilities
    # (0.61 and 0.29), and skipping the q update without replacement would give 0.19
    k, trials = 3, 6_000
    p, q = synthetic_pair(6, 0.5, seed=80)
    gen = torch.Generator().manual_seed(81)
    tree_of = StarTrees(root=0, k=k)
    rows_p, rows_q = p.expand(k + 1, -1), q.expand(k + 1, -1)
    rejected_all = 0
    for row in draw_children(q, k, rule, trials, gen).tolist():
        rejected_all += verify_tree(tree_of(tuple(row)), rows_p, rows_q, rule, gen).num_accepted == 0
    exact = reject_all_with_replacement if rule == "with_replacement" else reject_all_without_replacement
    expected = exact(p.double().numpy(), q.double().numpy(), k)
    assert 0.05 < expected < 0.95  # the identity is tested where it can fail
    assert_rate(rejected_all, trials, expected)


@pytest.mark.parametrize("rule", ["deterministic", "naive"])
def test_fixed_children_are_accepted_with_their_target_mass(rule: str) -> None:
    """Deterministic (top-k of q, then a repeated child) and naive (any children): some child is
    accepted with probability sum of p over the distinct child tokens."""
    p, q = synthetic_pair(8, 1.0, seed=90)
    top = q.topk(3).indices.tolist()
    children = [*top, top[0]]
    tree = TokenTree(torch.tensor([0, *children]), torch.tensor([-1, 0, 0, 0, 0]))
    gen = torch.Generator().manual_seed(91)
    trials = 2_000 if rule == "deterministic" else 8_000
    rows_p = p.expand(5, -1)
    accepted = sum(verify_tree(tree, rows_p, None, rule, gen).num_accepted for _ in range(trials))
    assert_rate(accepted, trials, float(p[top].sum()))


# ---- 4. degenerate drafts: exhausted q, p == q -------------------------------------------------------


@pytest.mark.parametrize("support,k", [(1, 3), (2, 4)])
def test_without_replacement_is_lossless_after_the_draft_is_exhausted(support: int, k: int) -> None:
    """q holds all its mass on ``support`` < k tokens: the later children are drawn uniformly over the tokens
    not yet drawn (e.g. q = onehot(a), children [a, b, c]) and tried as fixed candidates."""
    vocab, trials = 6, 4_000
    p, _ = synthetic_pair(vocab, 1.0, seed=100 + k)
    q = torch.zeros(vocab)
    q[torch.randperm(vocab, generator=torch.Generator().manual_seed(k))[:support]] = 1.0 / support
    gen = torch.Generator().manual_seed(102 + k)
    children = sequential_without_replacement(q, k, trials, gen)
    assert bool((q[children[:, :support]] > 0).all()) and bool((q[children[:, support:]] == 0).all())
    assert_follows(first_token_counts(p, q, children, "without_replacement", gen), p)


@pytest.mark.parametrize("rule", ["with_replacement", "without_replacement"])
def test_a_child_q_could_not_have_drawn_is_tried_as_a_fixed_candidate(rule: str) -> None:
    """A first child outside q's support (q(x) = 0, e.g. grafted by another drafter), then draws from q: accepting
    it with min(1, p(x) / 0) = 1 would emit x whenever drafted; tried as a fixed candidate it stays lossless."""
    p = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3, 0.0])
    q = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5, 0.0])
    gen = torch.Generator().manual_seed(121)
    draws = draw_children(q, 2, rule, 4_000, gen)
    children = torch.cat([torch.full((4_000, 1), 2), draws], dim=1)  # token 2: q = 0, p = 0.2
    assert_follows(first_token_counts(p, q, children, rule, gen), p)


def test_without_replacement_is_lossless_when_the_drafts_gumbel_top_k_runs_out_of_support() -> None:
    """The draft decoder's own draw (``_draw``: the top k of q / E) takes the zero-q tokens past q's support in a
    fixed order, not at random: q = [.6, .4, 0, 0, 0, 0] with 3 children always adds token 2. Verified as a
    uniform draw, that child was accepted with min(1, 4 p'(2)) and token 2 was never emitted (p = 0.2 there)."""
    from spectot.spec.proposers.draft_decoder import _draw

    p = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3, 0.0])
    q = torch.tensor([0.6, 0.4, 0.0, 0.0, 0.0, 0.0])
    gen = torch.Generator().manual_seed(120)
    children = _draw(q.expand(4_000, -1).contiguous(), 3, True, gen)
    assert bool((children[:, 2] == children[0, 2]).all())  # the third child: always the same zero-q token
    assert_follows(first_token_counts(p, q, children, "without_replacement", gen), p)


@pytest.mark.parametrize("rule", ["with_replacement", "without_replacement"])
@pytest.mark.parametrize("k", [1, 3])
def test_p_equal_to_q_accepts_the_first_child_and_stays_lossless(rule: str, k: int) -> None:
    """p == q: min(1, p/q) = 1, so the first child is always accepted (the 0/0 residual is never
    used) and the emitted token is the child itself, distributed as q = p."""
    p, _ = synthetic_pair(5, 1.0, seed=110)
    gen = torch.Generator().manual_seed(111 + k)
    trials = 3_000
    tree_of = StarTrees(root=0, k=k)
    rows = p.expand(k + 1, -1)
    counts = torch.zeros(5)
    for row in draw_children(p, k, rule, trials, gen).tolist():
        tree = tree_of(tuple(row))
        verdict = verify_tree(tree, rows, rows, rule, gen)
        assert verdict.path[:2] == [0, 1]
        assert 0 <= verdict.next_token < 5
        counts[first_emitted(tree, verdict)] += 1
    assert_follows(counts, p)
