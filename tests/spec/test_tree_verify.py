"""Tree verification rules are lossless: the emitted tokens follow the target (chi-square on
synthetic p, q), acceptance identities hold, and greedy follows the target's argmax."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2, chisquare

from spectot.engine.token_tree import TokenTree
from spectot.spec.sampling import sample_at
from spectot.spec.tree_verify import verify_tree, verify_tree_coupled, verify_tree_greedy

V = 8
TRIALS = 8_000


def markov(seed: int) -> torch.Tensor:
    """A (V, V) row-stochastic matrix with uneven rows (some tokens nearly impossible)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(V, V, generator=gen).pow(3).add(1e-3)
    return weights / weights.sum(-1, keepdim=True)


def draw_children(q: torch.Tensor, k: int, rule: str, gen: torch.Generator) -> list[int]:
    if rule == "with_replacement":
        return torch.multinomial(q, k, replacement=True, generator=gen).tolist()
    if rule == "deterministic":
        return torch.topk(q, k).indices.tolist()
    if rule == "without_replacement":
        picked, left = [], q.clone()
        for _ in range(k):
            if left.sum() <= 0:  # q exhausted: any choice, the verifier tries the rest as fixed candidates
                free = torch.ones(V, dtype=torch.bool)
                free[picked] = False
                left = free.float()
            x = int(torch.multinomial(left / left.sum(), 1, generator=gen))
            picked.append(x)
            left[x] = 0.0
        return picked
    return torch.multinomial(q, k, replacement=True, generator=gen).tolist()  # naive: any children


def two_level_tree(root: int, q_of, k: int, rule: str, gen: torch.Generator) -> TokenTree:
    """Root with k children drawn from q_of(root), each with k children drawn from q_of(child)."""
    tokens, parents = [root], [-1]
    for x in draw_children(q_of(root), k, rule, gen):
        tokens.append(x)
        parents.append(0)
        me = len(tokens) - 1
        for y in draw_children(q_of(x), k, rule, gen):
            tokens.append(y)
            parents.append(me)
    return TokenTree(torch.tensor(tokens), torch.tensor(parents))


@pytest.mark.parametrize("rule", ["with_replacement", "without_replacement", "deterministic", "naive"])
@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_follow_the_target(rule: str, k: int) -> None:
    target, draft = markov(1), markov(2)  # p(. | last token) = target[last]; q likewise
    gen = torch.Generator().manual_seed(100 + k)
    first = torch.zeros(V)
    second = torch.zeros(V, V)
    root = 3
    for _ in range(TRIALS):
        tree = two_level_tree(root, lambda t: draft[t], k, rule, gen)
        p = target[tree.tokens]  # (n, V): row u is the target after node u
        q = None if rule == "deterministic" else draft[tree.tokens]
        verdict = verify_tree(tree, p, q, rule, gen)
        emitted = tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token]
        first[emitted[0]] += 1
        if len(emitted) >= 2:
            second[emitted[0], emitted[1]] += 1
    expected = target[root] * TRIALS
    assert chisquare(first, expected).pvalue > 1e-3
    # given the first token a was accepted, the next emitted token follows target[a]: one chi-square
    # over all rows (cells with expected count < 5 pooled per row), not one test per row
    statistic, dof = 0.0, 0
    for a in range(V):
        n = float(second[a].sum())
        if n < 100:
            continue
        expected, observed = target[a] * n, second[a]
        small = expected < 5
        cells_e = torch.cat([expected[~small], expected[small].sum().view(1)])
        cells_o = torch.cat([observed[~small], observed[small].sum().view(1)])
        keep = cells_e > 0
        statistic += float(((cells_o[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum())
        dof += int(keep.sum()) - 1
    assert dof > 0
    assert chi2.sf(statistic, dof) > 1e-3


def test_one_child_accepts_with_one_minus_tv() -> None:
    p, q = markov(5)[0], markov(6)[0]
    gen = torch.Generator().manual_seed(7)
    accepted = 0
    for _ in range(TRIALS):
        x = int(torch.multinomial(q, 1, generator=gen))
        tree = TokenTree(torch.tensor([0, x]), torch.tensor([-1, 0]))
        accepted += verify_tree(tree, torch.stack([p, p]), torch.stack([q, q]), "with_replacement", gen).num_accepted
    rate, expected = accepted / TRIALS, 1 - 0.5 * float((p - q).abs().sum())
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / TRIALS) ** 0.5


def test_deterministic_top_k_accepts_with_the_children_target_mass() -> None:
    p = markov(8)[0]
    children = [5, 1, 6]
    tree = TokenTree(torch.tensor([0, *children]), torch.tensor([-1, 0, 0, 0]))
    gen = torch.Generator().manual_seed(9)
    accepted = sum(verify_tree(tree, p.expand(4, V), None, "deterministic", gen).num_accepted for _ in range(TRIALS))
    expected = float(p[children].sum())
    assert abs(accepted / TRIALS - expected) < 4 * (expected * (1 - expected) / TRIALS) ** 0.5


def test_without_replacement_survives_an_exhausted_draft() -> None:
    p = torch.full((V,), 1.0 / V)
    q = torch.zeros(V)
    q[2] = 1.0  # one token holds all the draft mass: the second child is a fixed candidate
    tree = TokenTree(torch.tensor([0, 2, 5]), torch.tensor([-1, 0, 0]))
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = verify_tree(tree, p.expand(3, V), q.expand(3, V), "without_replacement", gen)
        assert 0 <= verdict.next_token < V


def test_greedy_follows_the_argmax_path() -> None:
    # docstring example: [t0, a, b, c], parents [-1, 0, 0, 1]; argmax after t0 is b (token 12)
    tree = TokenTree(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1]))
    assert verify_tree_greedy(tree, torch.tensor([12, 13, 40, 41])).path == [0, 2]
    assert verify_tree_greedy(tree, torch.tensor([12, 13, 40, 41])).next_token == 40
    full = verify_tree_greedy(tree, torch.tensor([11, 13, 0, 42]))
    assert (full.path, full.next_token) == ([0, 1, 3], 42)
    assert verify_tree_greedy(tree, torch.tensor([7, 0, 0, 0])).path == [0]


def test_greedy_rule_through_verify_tree_equals_verify_tree_greedy() -> None:
    tree = TokenTree(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1]))
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    assert verify_tree(tree, logits.softmax(-1), None, "greedy", None) == verify_tree_greedy(tree, logits.argmax(-1))


def test_coupled_tree_follows_plain_decodings_draws() -> None:
    """A deterministic tree verified by the coupled rule emits exactly plain decoding's draws at each
    depth (same seed), and accepts with the children's target mass."""
    m = markov(11)
    hits = 0
    for seed in range(TRIALS // 4):
        tree = two_level_tree(0, lambda x: m[x], 3, "deterministic", torch.Generator())
        p = m[tree.tokens]  # the target after each node's token (a Markov chain)
        depths = tree.depths.tolist()
        verdict = verify_tree_coupled(tree, lambda u, p=p, s=seed, d=depths: sample_at(p[u], s, d[u]))
        plain, x = [], 0
        for depth in range(len(verdict.path)):
            x = sample_at(m[x], seed, depth)
            plain.append(x)
        assert tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token] == plain
        hits += verdict.num_accepted > 0
    expected = float(m[0][torch.topk(m[0], 3).indices].sum())
    n = TRIALS // 4
    assert abs(hits / n - expected) < 4 * (expected * (1 - expected) / n) ** 0.5
