"""verify_chain is lossless: emitted tokens follow the target whatever the draft (Leviathan et al. 2023).

The statistical tests simulate a tiny Markov "language": the target is a transition matrix T (V, V),
so p(. | prefix) = T[last token], and the draft at chain position i is a transition matrix Q_i.
The first two emitted tokens after prompt token ``PROMPT`` are then exactly distributed as
T[PROMPT, a] * T[a, b], which checks that every row of p is used at the right position (a target
whose rows were all equal could not tell row 0 from row 1). When the first verification emits only
one token (a rejection at draft position 1), a second verification step continues from it, as the
decoding loop does.

verify_chain takes one chain per call (60-120 us on CPU), so trials cannot be vectorised: each case
runs N_TRIALS chains (about 1.5 calls per trial), not 1e5, to keep the file near 30 s on 2 cores.
The TV bound therefore scales with the sample size (see ``assert_distribution``). Every case also
reuses one simulation for its three tests (``simulate`` is cached).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from spectot.spec.sampling import sample_at
from spectot.spec.verify import residual, verify_chain, verify_chain_coupled, verify_chain_greedy

V = 8
PROMPT = 0
N_TRIALS = 16_000  # per case; see the module docstring
KINDS = ("same", "disjoint", "onehot", "random")


# ----------------------------------------------------------------------------- helpers


def _dirichlet(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Flat-Dirichlet probability rows: normalised Exp(1) draws."""
    e = -torch.rand(shape, generator=gen, dtype=torch.float64).neg().log1p()  # -log(1 - u) ~ Exp(1)
    return (e / e.sum(-1, keepdim=True)).float()


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


def assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """counts (C,) of n samples vs exact probabilities (C,): no mass off the support, chi-square
    p-value > 1e-3 (cells with expected count < 5 pooled), and TV below twice the TV an exact
    sampler shows on average, E|p_hat - p| ~ sqrt(2 p (1 - p) / (pi n)) per cell (for V = 8 and
    n = 1e5 this bound is ~0.007, tighter than 0.01)."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    expected = expected / expected.sum()  # float32 rows sum to 1 only up to rounding
    n = float(counts.sum())
    assert counts[expected == 0].sum() == 0, "emitted a token the target gives probability 0"
    exp_counts = expected * n
    big = exp_counts >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([exp_counts[big], exp_counts[~big].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    pvalue = chisquare(obs.numpy(), exp.numpy()).pvalue
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.2e}: {obs.tolist()} vs {exp.tolist()}"
    expected_tv = 0.5 * float((2 * expected * (1 - expected) / (math.pi * n)).sqrt().sum())
    distance = tv(counts / n, expected)
    assert distance < 2 * expected_tv, f"TV {distance:.4f} >= {2 * expected_tv:.4f}"


@dataclass(frozen=True)
class Case:
    """A target T and per-position drafts Q (k, V, V); ``deterministic`` drafts are one-hot rows and
    are passed to verify_chain as q=None."""

    T: torch.Tensor  # (V, V) target transitions
    Q: torch.Tensor  # (k, V, V) draft transitions at chain positions 1..k
    deterministic: bool

    @property
    def k(self) -> int:
        return self.Q.shape[0]


def make_case(kind: str, k: int) -> Case:
    gen = torch.Generator().manual_seed(1000 * KINDS.index(kind) + k)
    T = _dirichlet((V, V), gen)
    if kind == "same":  # q == p at every position
        return Case(T, T.expand(k, V, V).clone(), False)
    if kind == "disjoint":  # target on even tokens, draft on odd tokens: every draft is rejected
        even = torch.arange(V) % 2 == 0
        T = T * even
        T = T / T.sum(-1, keepdim=True)
        Q = _dirichlet((k, V, V), gen) * ~even
        return Case(T, Q / Q.sum(-1, keepdim=True), False)
    if kind == "onehot":  # a greedy-like draft: a fixed next token per (position, previous token),
        # usually the target's mode so that later positions get tested too
        nxt = (T + 0.3 * torch.rand((k, V, V), generator=gen)).argmax(-1)  # (k, V)
        return Case(T, torch.nn.functional.one_hot(nxt, V).float(), True)
    if kind == "random":  # an unrelated draft that changes with position and context
        return Case(T, _dirichlet((k, V, V), gen), False)
    raise ValueError(kind)


def _draft(case: Case, prev: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(N,) previous tokens -> (N, k) draft chains, x_i ~ Q_i[x_{i-1}]."""
    tokens = [prev]
    for i in range(case.k):
        tokens.append(torch.multinomial(case.Q[i, tokens[-1]], 1, generator=gen).squeeze(1))
    return torch.stack(tokens[1:], 1)


def _verify_all(case: Case, prev: torch.Tensor, gen: torch.Generator) -> list[list[int]]:
    """(N,) previous tokens -> one fresh draft and verification each -> emitted tokens per trial."""
    drafts = _draft(case, prev, gen)
    context = torch.cat([prev[:, None], drafts], 1)  # (N, k + 1): the token each p row conditions on
    p = case.T[context].unbind(0)  # N x (k + 1, V); unbind once, indexing per trial is slow
    q = case.Q[torch.arange(case.k), context[:, :-1]].unbind(0)  # N x (k, V)
    emitted = []
    for draft, draft_list, p_n, q_n in zip(drafts.unbind(0), drafts.tolist(), p, q):
        verdict = verify_chain(draft, p_n, None if case.deterministic else q_n, gen)
        emitted.append(draft_list[: verdict.num_accepted] + [verdict.next_token])
    return emitted


@dataclass(frozen=True)
class Run:
    first_accepts: torch.Tensor  # (N,) accepted drafts in the first verification
    pairs: torch.Tensor  # (N, 2) first two emitted tokens


@functools.cache
def simulate(kind: str, k: int) -> Run:
    case = make_case(kind, k)
    gen = torch.Generator().manual_seed(7 + 100 * KINDS.index(kind) + k)
    emitted = _verify_all(case, torch.full((N_TRIALS,), PROMPT), gen)
    first_accepts = torch.tensor([len(e) - 1 for e in emitted])
    short = [n for n, e in enumerate(emitted) if len(e) == 1]
    if short:  # continue those streams for one more step, from the token they emitted
        more = _verify_all(case, torch.tensor([emitted[n][0] for n in short]), gen)
        for n, e in zip(short, more):
            emitted[n] = emitted[n] + e
    return Run(first_accepts, torch.tensor([e[:2] for e in emitted]))


def acceptance_probs(case: Case) -> list[float]:
    """Exact P(at least i drafts accepted), i = 1..k: a_i(x) = P(x_1..x_i accepted, x_i = x) obeys
    a_1 = min(p_1, q_1), a_{i+1}(y) = sum_x a_i(x) min(T[x, y], Q_{i+1}[x, y])."""
    a = torch.minimum(case.T[PROMPT], case.Q[0, PROMPT]).double()
    out = [float(a.sum())]
    for i in range(1, case.k):
        a = a @ torch.minimum(case.T, case.Q[i]).double()
        out.append(float(a.sum()))
    return out


# Each case costs about N_TRIALS * (1 + P(reject x_1)) verify_chain calls, so the grid is thinned:
# "same" always accepts and "disjoint" always rejects x_1, so k barely matters to them, and the
# one-hot path (the slowest per call) runs its shortest and longest chains; "random" runs k = 1..3.
GRID = [("same", 1), ("same", 2), ("disjoint", 2), ("onehot", 1), ("onehot", 3)]
GRID += [("random", k) for k in (1, 2, 3)]


# ----------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize(("kind", "k"), GRID)
def test_first_emitted_token_follows_target(kind: str, k: int) -> None:
    case, run = make_case(kind, k), simulate(kind, k)
    counts = torch.bincount(run.pairs[:, 0], minlength=V)
    assert_distribution(counts, case.T[PROMPT])


@pytest.mark.parametrize(("kind", "k"), GRID)
def test_first_two_emitted_tokens_follow_target(kind: str, k: int) -> None:
    case, run = make_case(kind, k), simulate(kind, k)
    counts = torch.bincount(run.pairs[:, 0] * V + run.pairs[:, 1], minlength=V * V)
    joint = case.T[PROMPT][:, None] * case.T  # (V, V): P(a, b) = T[prompt, a] T[a, b]
    assert_distribution(counts, joint)


# ----------------------------------------------------------------------------- acceptance identities


@pytest.mark.parametrize(("kind", "k"), GRID)
def test_acceptance_rate_matches_one_minus_tv(kind: str, k: int) -> None:
    """P(x_1 accepted) = sum_x min(p, q) = 1 - TV(p, q); for a one-hot draft x that is p(x); and
    P(x_1..x_i accepted) follows the same rule down the chain."""
    case, run = make_case(kind, k), simulate(kind, k)
    p1, q1 = case.T[PROMPT], case.Q[0, PROMPT]
    exact = acceptance_probs(case)
    assert exact[0] == pytest.approx(1 - tv(p1, q1), abs=1e-6)
    if kind == "same":
        assert exact == pytest.approx([1.0] * k, abs=1e-6)
    if kind == "disjoint":
        assert exact == pytest.approx([0.0] * k)
    if kind == "onehot":
        assert exact[0] == pytest.approx(float(p1[int(q1.argmax())]))
    for i, a in enumerate(exact, start=1):
        observed = float((run.first_accepts >= i).double().mean())
        stderr = math.sqrt(max(a * (1 - a), 0.0) / N_TRIALS)
        # the 1e-6 slack absorbs float32 rounding of a, which is exactly 0 or 1 for same/disjoint
        assert abs(observed - a) <= 4 * stderr + 1e-6, f"P(>= {i} accepted): {observed:.4f} vs {a:.4f}"


def test_onehot_draft_accepted_with_target_probability() -> None:
    """A deterministic draft token x (q=None) is accepted with probability exactly p(x)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.1, 0.3, 0.6], [0.2, 0.2, 0.6]])
    draft = torch.tensor([1])
    n = 20_000
    accepted = sum(verify_chain(draft, p, None, gen).num_accepted for _ in range(n))
    stderr = math.sqrt(0.3 * 0.7 / n)
    assert abs(accepted / n - 0.3) <= 4 * stderr


def test_a_token_q_could_not_have_drawn_is_a_fixed_candidate() -> None:
    """q(x) = 0 for the draft token (a head bug, a restricted q): the chain rule accepted it always (u * 0 < p(x));
    as the tree rule does, it is a fixed candidate: accepted with p(x), the first token still distributed as p."""
    gen = torch.Generator().manual_seed(5)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    n = 20_000
    first = torch.zeros(3)
    accepted = 0
    for _ in range(n):
        verdict = verify_chain(torch.tensor([2]), p, q, gen)
        accepted += verdict.num_accepted
        first[2 if verdict.num_accepted else verdict.next_token] += 1
    assert abs(accepted / n - 0.2) <= 4 * math.sqrt(0.2 * 0.8 / n)
    assert chisquare(first.numpy(), (p[0] * n).numpy()).pvalue > 1e-3


# ----------------------------------------------------------------------------- hand-made cases


def test_certain_draft_is_always_accepted_and_bonus_comes_from_last_row() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.eye(4)[[2, 3, 1]]  # (k + 1, V): the target is certain of 2, then 3, then 1
    for q in (None, torch.eye(4)[[2, 3]]):
        verdict = verify_chain(torch.tensor([2, 3]), p, q, gen)
        assert (verdict.num_accepted, verdict.next_token) == (2, 1)


def test_impossible_draft_is_rejected_and_recovered_from_target() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.eye(4)[[2, 3, 1]]
    for q in (None, torch.eye(4)[[0, 3]]):
        verdict = verify_chain(torch.tensor([0, 3]), p, q, gen)
        assert (verdict.num_accepted, verdict.next_token) == (0, 2)


def test_empty_draft_samples_from_first_row() -> None:
    gen = torch.Generator().manual_seed(0)
    verdict = verify_chain(torch.empty(0, dtype=torch.int64), torch.eye(5)[[4]], None, gen)
    assert (verdict.num_accepted, verdict.next_token) == (0, 4)


def test_seeded_verification_is_reproducible() -> None:
    p = _dirichlet((4, V), torch.Generator().manual_seed(1))
    q = _dirichlet((3, V), torch.Generator().manual_seed(2))
    draft = torch.tensor([1, 5, 2])

    def run(seed: int) -> list:
        gen = torch.Generator().manual_seed(seed)
        return [verify_chain(draft, p, q, gen) for _ in range(200)]

    assert run(11) == run(11)
    assert run(11) != run(12)


# ----------------------------------------------------------------------------- residual


def test_residual_of_equal_distributions_is_p_without_nan() -> None:
    p = torch.tensor([[0.25, 0.25, 0.5], [1.0, 0.0, 0.0]])
    r = residual(p, p.clone())
    assert not r.isnan().any()
    assert torch.equal(r, p)


def test_residual_is_normalised_positive_part() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.1, 0.3, 0.4])
    # max(p - q, 0) = [0.3, 0.2, 0, 0]
    torch.testing.assert_close(residual(p, q), torch.tensor([0.6, 0.4, 0.0, 0.0]))


def test_residual_of_disjoint_supports_is_p() -> None:
    p = torch.tensor([0.7, 0.0, 0.3, 0.0])
    q = torch.tensor([0.0, 0.5, 0.0, 0.5])
    torch.testing.assert_close(residual(p, q), p)


def test_residual_works_row_by_row() -> None:
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    torch.testing.assert_close(residual(p, q), torch.tensor([[0.5, 0.5], [1.0, 0.0]]))


# ----------------------------------------------------------------------------- greedy


def test_greedy_all_accepted_takes_bonus_from_last_argmax() -> None:
    verdict = verify_chain_greedy(torch.tensor([4, 1, 7]), torch.tensor([4, 1, 7, 2]))
    assert (verdict.num_accepted, verdict.next_token) == (3, 2)


@pytest.mark.parametrize(
    ("draft", "target_argmax", "accepted", "next_token"),
    [
        ([4, 1, 7], [5, 1, 7, 2], 0, 5),  # first token wrong
        ([4, 1, 7], [4, 3, 7, 2], 1, 3),  # later matches do not count after a mismatch
        ([4, 1, 7], [4, 1, 0, 2], 2, 0),
    ],
)
def test_greedy_stops_at_first_mismatch(draft, target_argmax, accepted, next_token) -> None:
    verdict = verify_chain_greedy(torch.tensor(draft), torch.tensor(target_argmax))
    assert (verdict.num_accepted, verdict.next_token) == (accepted, next_token)


def test_greedy_empty_draft_takes_first_argmax() -> None:
    verdict = verify_chain_greedy(torch.empty(0, dtype=torch.int64), torch.tensor([6]))
    assert (verdict.num_accepted, verdict.next_token) == (0, 6)


# ----------------------------------------------------------------------------- coupled


def test_coupled_verification_emits_plain_decodings_draws() -> None:
    """Whatever the deterministic draft, the emitted tokens are the ones plain decoding draws at those
    positions with the same seed: accepted ones equal the draft, the last one is the target's draw."""
    gen = torch.Generator().manual_seed(3)
    for seed in range(300):
        p = _dirichlet((4, V), gen)
        plain = [sample_at(p[i], seed, 10 + i) for i in range(4)]
        draft = torch.tensor(plain[:3])
        wrong = int(torch.randint(3, (), generator=gen))
        draft[wrong] = (draft[wrong] + 1 + seed % (V - 1)) % V  # differs from plain's draw there
        verdict = verify_chain_coupled(draft, lambda i, p=p, seed=seed: sample_at(p[i], seed, 10 + i))
        assert verdict.num_accepted == wrong
        assert draft[:wrong].tolist() + [verdict.next_token] == plain[: wrong + 1]


def test_coupled_onehot_draft_is_accepted_with_target_probability() -> None:
    p = torch.tensor([[0.1, 0.6, 0.3] + [0.0] * (V - 3), [1.0 / V] * V])
    accepted = sum(
        verify_chain_coupled(torch.tensor([1]), lambda i, s=seed: sample_at(p[i], s, i)).num_accepted
        for seed in range(N_TRIALS)
    )
    assert abs(accepted / N_TRIALS - 0.6) < 4 * (0.6 * 0.4 / N_TRIALS) ** 0.5


def test_coupled_all_accepted_takes_the_bonus_draw() -> None:
    p = torch.eye(V)[[2, 5, 7]]
    verdict = verify_chain_coupled(torch.tensor([2, 5]), lambda i: sample_at(p[i], 0, i))
    assert (verdict.num_accepted, verdict.next_token) == (2, 7)


def test_a_nan_draft_distribution_rejects_instead_of_accepting_forbidden_tokens() -> None:
    """A draft whose logits overflowed hands q = NaN: the chain rule's "reject iff u q >= p" read False and
    accepted every draft token, one the target gives probability 0 too; now it rejects, as the tree rule does."""
    p = torch.tensor([[0.9, 0.1, 0.0]] * 3)
    q = torch.full((2, 3), float("nan"))
    for seed in range(20):
        verdict = verify_chain(torch.tensor([2, 2]), p, q, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0 and verdict.next_token in (0, 1)
