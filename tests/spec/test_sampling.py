"""target_probs turns logits into the distribution every decoding path samples from; sample draws from it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from spectot.spec.sampling import (
    CoupledNoise,
    SamplingParams,
    argmax,
    coupled_pick,
    _exponential,
    logsumexp_rows,
    noise_at,
    noise_key,
    position_noise,
    sample,
    sample_at,
    target_probs,
)

SAMPLING = SamplingParams(do_sample=True)


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"temperature": 1e-39}, "use 0 for greedy"),  # logits / T overflowed: NaN probabilities
    ],
)
def test_invalid_params_raise_value_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(do_sample=True, **kwargs)


def test_boundary_params_are_valid() -> None:
    params = SamplingParams(do_sample=True, temperature=0.0, top_k=0, top_p=1.0)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 0, 1.0)


@pytest.mark.parametrize(
    ("params", "greedy"),
    [
        (SamplingParams(), True),  # do_sample defaults to False, as in transformers
        (SamplingParams(do_sample=True), False),
        (SamplingParams(do_sample=True, temperature=0.0), True),
        (SamplingParams.from_temperature(0.0), True),
        (SamplingParams.from_temperature(0.7), False),
    ],
)
def test_greedy_flag(params: SamplingParams, greedy: bool) -> None:
    assert params.greedy is greedy


def test_from_temperature_keeps_filters_and_a_valid_temperature() -> None:
    assert SamplingParams.from_temperature(0.7, top_k=5, top_p=0.9) == SamplingParams(True, 0.7, 5, 0.9)
    assert SamplingParams.from_temperature(0.0).temperature == 1.0  # unused when greedy, but valid


# ----------------------------------------------------------------------------- target_probs


def test_greedy_is_one_hot_on_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 4.0]])
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert torch.equal(target_probs(logits, SamplingParams()), expected)
    assert torch.equal(target_probs(logits, SamplingParams(do_sample=True, temperature=0.0)), expected)


def test_greedy_tie_goes_to_lowest_index() -> None:
    probs = target_probs(torch.tensor([0.0, 3.0, 3.0, 1.0]), SamplingParams())
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_greedy_ignores_top_k_and_top_p() -> None:
    logits = torch.tensor([0.3, -0.2, 1.5, 1.4])
    probs = target_probs(logits, SamplingParams(do_sample=False, top_k=2, top_p=0.5))
    assert probs.tolist() == [0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scales_logits_before_softmax(temperature: float) -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = target_probs(logits, SamplingParams(do_sample=True, temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1))


def test_output_is_float32_for_half_logits() -> None:
    logits = torch.tensor([1.0, 2.0, 0.5], dtype=torch.bfloat16)
    probs = target_probs(logits, SAMPLING)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float(), -1))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_keeps_exactly_k_largest(k: int) -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 2.5, 0.0, 1.0])  # no ties
    probs = target_probs(logits, SamplingParams(do_sample=True, top_k=k))
    top = logits.topk(k).indices
    assert set(probs.nonzero().flatten().tolist()) == set(top.tolist())
    torch.testing.assert_close(probs[top], torch.softmax(logits[top], -1))


def test_top_k_applies_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    probs = target_probs(logits, SamplingParams(do_sample=True, top_k=2))
    assert (probs > 0).tolist() == [[True, True, False, False], [False, False, True, True]]


@pytest.mark.parametrize("k", [0, 4, 10])
def test_top_k_off_or_at_least_vocab_is_plain_softmax(k: int) -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    probs = target_probs(logits, SamplingParams(do_sample=True, top_k=k))
    torch.testing.assert_close(probs, logits.softmax(-1))


# tokens in vocabulary order have probabilities 0.15, 0.5, 0.05, 0.3; sorted: 0.5, 0.3, 0.15, 0.05
# with cumulative mass 0.5, 0.8, 0.95, 1.0
TOP_P_PROBS = [0.15, 0.5, 0.05, 0.3]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.3, [0.0, 1.0, 0.0, 0.0]),  # the most likely token alone reaches 0.3 (and always stays)
        (0.75, [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]),  # 0.5 < 0.75 <= 0.5 + 0.3
        (0.9, [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]),  # 0.8 < 0.9 <= 0.95
        (0.99, [0.15, 0.5, 0.05, 0.3]),  # 0.95 < 0.99: everything stays
        (1.0, [0.15, 0.5, 0.05, 0.3]),  # off
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p: float, expected: list[float]) -> None:
    probs = target_probs(_logits_of(TOP_P_PROBS), SamplingParams(do_sample=True, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expected))


def test_top_p_applies_after_temperature() -> None:
    # temperature 0.5 squares and renormalises: [0.8, 0.2] -> [0.941..., 0.0588...], so top_p 0.9
    # keeps only the first token (at temperature 1 it would need both)
    logits = _logits_of([0.8, 0.2])
    probs = target_probs(logits, SamplingParams(do_sample=True, temperature=0.5, top_p=0.9))
    assert probs.tolist() == [1.0, 0.0]
    assert (target_probs(logits, SamplingParams(do_sample=True, top_p=0.9)) > 0).all()


def test_top_p_applies_to_top_k_renormalised_mass() -> None:
    # top_k 2 keeps 0.5 and 0.3 -> 0.625, 0.375; top_p 0.6 then needs only the first
    probs = target_probs(_logits_of(TOP_P_PROBS), SamplingParams(do_sample=True, top_k=2, top_p=0.6))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_p_applies_per_row() -> None:
    logits = torch.stack([_logits_of(TOP_P_PROBS), _logits_of(TOP_P_PROBS).flip(0)])
    probs = target_probs(logits, SamplingParams(do_sample=True, top_p=0.75))
    assert (probs > 0).tolist() == [[False, True, False, True], [True, False, True, False]]


# ----------------------------------------------------------------------------- sample


def test_sample_draws_from_probs() -> None:
    p = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05])
    n = 100_000
    draws = sample(p.expand(n, -1), torch.Generator().manual_seed(0))
    assert draws.shape == (n,) and draws.dtype == torch.int64
    counts = torch.bincount(draws, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    support = p > 0
    expected = n * p[support].double() / p.double().sum()  # float32 p sums to 1 only up to rounding
    pvalue = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > 1e-3
    assert 0.5 * float((counts / n - p.double()).abs().sum()) < 0.01


def test_sample_one_hot_is_deterministic() -> None:
    probs = torch.eye(5)[[3, 0, 4]]
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [3, 0, 4]


def test_sample_keeps_leading_dims() -> None:
    probs = torch.full((2, 3, 6), 1 / 6)
    assert sample(probs, None).shape == (2, 3)


def test_seeded_sampling_reproduces() -> None:
    probs = torch.full((1000, 16), 1 / 16)
    a = sample(probs, torch.Generator().manual_seed(42))
    b = sample(probs, torch.Generator().manual_seed(42))
    c = sample(probs, torch.Generator().manual_seed(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_generator_advances_between_calls() -> None:
    gen = torch.Generator().manual_seed(1)
    probs = torch.full((1000, 16), 1 / 16)
    assert not torch.equal(sample(probs, gen), sample(probs, gen))


def test_sample_from_target_probs_stays_in_top_k() -> None:
    logits = torch.randn(20_000, 32, generator=torch.Generator().manual_seed(3))
    probs = target_probs(logits, SamplingParams(do_sample=True, top_k=4))
    draws = sample(probs, torch.Generator().manual_seed(4))
    allowed = logits.topk(4, -1).indices
    assert (allowed == draws[:, None]).any(-1).all()
    assert math.isclose(float(probs.sum(-1).mean()), 1.0, rel_tol=1e-5)


# ----------------------------------------------------------------------------- sample_at


def test_position_noise_is_a_function_of_seed_and_position() -> None:
    a = position_noise(7, 3, 64)
    assert a.shape == (64,) and a.dtype == torch.float64 and bool((a > 0).all())
    assert torch.equal(a, position_noise(7, 3, 64))
    assert not torch.equal(a, position_noise(7, 4, 64)) and not torch.equal(a, position_noise(8, 3, 64))
    assert torch.equal(position_noise(-1, 3, 8), position_noise(2**64 - 1, 3, 8))  # any int seed works
    draws = torch.cat([position_noise(0, j, 10) for j in range(2_000)]).numpy()
    assert kstest(draws, "expon").pvalue > 1e-3  # Exp(1) over positions of one stream


def test_noise_at_token_ids_is_the_positions_noise_there() -> None:
    full = position_noise(9, 4, 300)
    ids = torch.tensor([299, 0, 17, 17, 150])
    assert torch.equal(noise_at(9, 4, ids), full[ids])  # any subset, any order: each value is (seed, j, i)'s own
    assert torch.equal(CoupledNoise(9).at(4, ids), full[ids])
    # the kernel and numpy draw the same u: their -log u agree to the last bits of a double
    numpy_path = torch.from_numpy(_exponential(noise_key(9, 4), np.arange(300)))
    assert torch.allclose(numpy_path, full, rtol=1e-15, atol=0)


def _key_with_top_uniform_at(i: int) -> int:
    """A noise key whose hash at token i is all ones (u's top value): SplitMix64's output function inverted."""
    mask = 2**64 - 1

    def unshift(z: int, s: int) -> int:  # the x with x ^ (x >> s) == z
        x = z
        for _ in range(64 // s + 1):
            x = z ^ (x >> s)
        return x

    z = unshift(mask, 31)
    z = unshift(z * pow(0x94D049BB133111EB, -1, 2**64) & mask, 27)
    z = unshift(z * pow(0xBF58476D1CE4E5B9, -1, 2**64) & mask, 30)
    key = (z - 0x9E3779B97F4A7C15 * (i + 1)) & mask
    return key - 2**64 if key >= 2**63 else key


def test_the_top_uniform_is_below_1(monkeypatch) -> None:
    """53 bits of ones plus a half rounded u to 1: E = -0, so a token of probability 0 drew 0 / -0 = NaN in
    coupled_pick and a likely one a ratio of -inf (it could never win) where its E is the smallest possible."""
    import spectot.spec.sampling as sampling

    key = _key_with_top_uniform_at(5)
    ids = torch.arange(8)
    paths = [torch.from_numpy(_exponential(key, ids.numpy()))]
    module = sampling.noise_ops()
    if module is not None:
        paths.append(module.exponential(key, ids))
    for noise in paths:
        assert 0 < float(noise[5]) < 1e-15 and bool((noise > 0).all())
        p = torch.full((8,), 1 / 7, dtype=torch.float64)
        p[5] = 0.0
        assert not math.isnan(float((p / noise).max())) and int(coupled_pick(p, noise)) != 5
        assert int(coupled_pick(torch.full((8,), 1 / 8), noise)) == 5  # the smallest E wins a flat race
    monkeypatch.setattr(sampling, "noise_key", lambda seed, position: key)
    assert sampling.sample_at(torch.full((8,), 1 / 8), 0, 0) == 5  # the kernel's race (or torch's) agrees


@pytest.mark.parametrize("shape", ["random", "flat", "peaked", "ties", "zeros"])
def test_sample_at_without_noise_is_the_race_over_the_whole_noise(shape: str) -> None:
    """The kernel's race (exact logs only where p_i / (1 - u_i) can still win) picks what argmax p / E over all of
    E_j picks, ties to the lowest index, on many positions of distributions of every kind."""
    gen = torch.Generator().manual_seed(0)
    V = 5_000
    for j in range(60):
        if shape == "random":
            p = torch.softmax(3 * torch.randn(V, generator=gen), 0)
        elif shape == "flat":
            p = torch.full((V,), 1.0 / V)
        elif shape == "peaked":
            p = torch.softmax(12 * torch.randn(V, generator=gen), 0)
        elif shape == "ties":  # a few equal large values among tiny ones
            p = torch.full((V,), 1e-9)
            p[torch.randperm(V, generator=gen)[:4]] = 0.25
        else:  # most tokens outside a nucleus (probability 0)
            p = torch.zeros(V)
            keep = torch.randperm(V, generator=gen)[:30]
            p[keep] = torch.rand(30, generator=gen)
            p = p / p.sum()
        assert sample_at(p, 21, j) == int(coupled_pick(p, position_noise(21, j, V))), (shape, j)
        assert sample_at(p.double(), 21, j) == int(coupled_pick(p.double(), position_noise(21, j, V)))


def test_a_guess_with_the_targets_noise_matches_its_draw_far_more_often_than_the_argmax() -> None:
    """Coupled guesses: a draft equal to the target always matches; a close one matches at least
    (1 - TV) / (1 + TV) of the time (Daliri et al. 2024), where its argmax matches only p(argmax q)."""
    p = torch.tensor([0.22, 0.2, 0.18, 0.15, 0.1, 0.08, 0.07, 0.0])
    q = torch.tensor([0.18, 0.24, 0.16, 0.15, 0.12, 0.08, 0.05, 0.02])
    n = 4_000
    noises = [position_noise(11, j, 8) for j in range(n)]
    assert all(int(coupled_pick(p, e)) == sample_at(p, 11, j) for j, e in enumerate(noises[:200]))
    matched = sum(int(coupled_pick(q, e)) == sample_at(p, 11, j, e) for j, e in enumerate(noises)) / n
    tv = 0.5 * float((p - q).abs().sum())
    assert matched > (1 - tv) / (1 + tv) - 4 * (0.25 / n) ** 0.5
    assert matched > float(p[q.argmax()]) + 0.3  # 0.2 for the argmax guess


def test_sample_at_draws_from_probs_across_positions_of_one_stream() -> None:
    p = torch.tensor([0.5, 0.0, 0.1, 0.4])
    n = 20_000
    counts = torch.bincount(torch.tensor([sample_at(p, 3, j) for j in range(n)]), minlength=4).double()
    assert counts[1] == 0
    assert chisquare(counts[[0, 2, 3]].numpy(), (n * p[[0, 2, 3]].double()).numpy()).pvalue > 1e-3
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0])
    assert {sample_at(one_hot, s, 0) for s in range(50)} == {2}  # all mass on the last token with mass


def test_sample_at_draws_from_probs_across_seeds() -> None:
    """Each (seed, position) is one exact draw from p: the counts over many seeds follow p."""
    p = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.2, 0.05])
    n = 20_000
    counts = torch.bincount(torch.tensor([sample_at(p, seed, 5) for seed in range(n)]), minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    support = p > 0
    expected = n * p[support].double() / p.double().sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_with_ties_to_the_lowest_index(dtype: torch.dtype) -> None:
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]], dtype=dtype)
    assert argmax(x).tolist() == [1, 0, 0] == torch.argmax(x, -1).tolist()
    assert int(argmax(x[0])) == 1
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # nuclei of ~all, thousands and a few tokens
def test_top_p_read_off_the_top_tokens_equals_a_full_sort(scale: float) -> None:
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(1)) * scale
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop = torch.zeros_like(order, dtype=torch.bool).scatter_(
        -1, order, (sorted_probs.cumsum(-1) - sorted_probs) >= 0.9
    )
    expected = logits.masked_fill(drop, float("-inf")).softmax(-1)
    torch.testing.assert_close(target_probs(logits, SamplingParams(do_sample=True, top_p=0.9)), expected)


# -- argmax and log-normalisers of logit rows (a verification's host work) --------------------------


@pytest.mark.parametrize("width", [1, 7, 8, 33, 49152])
def test_argmax_is_torchs_lowest_index_among_ties(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x = torch.randint(-3, 3, (9, width), generator=g).float()  # small integers: many ties
    x[0] = float("-inf")  # no finite entry: index 0, as torch
    x[1, -1] = 1e9  # the maximum in the tail past the last full lane block
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x[2]), x[2].argmax(-1))  # one row (numpy's path)


def test_logsumexp_rows_match_float64_and_depend_on_their_row_only() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 49152, generator=g) * 8
    x[2, ::3] = float("-inf")
    x[4] = float("-inf")  # no probability anywhere: -inf, as torch
    rows = [5, 0, 2, 4, 0]  # any order, repeats allowed
    got = logsumexp_rows(x, rows)
    want = x.double()[rows].logsumexp(-1)
    assert got[3] == float("-inf")
    assert torch.allclose(torch.tensor(got)[[0, 1, 2, 4]], want[[0, 1, 2, 4]].float(), rtol=1e-6, atol=0)
    assert logsumexp_rows(x[[2]].clone(), [0]) == [got[2]]  # the same row alone: the same bits


def test_logprobs_of_a_verified_path_are_the_raw_log_softmax() -> None:
    from spectot.spec.decoding import _logprobs

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 4
    got = _logprobs(x, [7, 250, 3], rows=[0, 2, 4])
    want = x.double().log_softmax(-1)[[0, 2, 4], [7, 250, 3]]
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=1e-5)


def test_a_rows_nucleus_does_not_depend_on_the_rows_beside_it() -> None:
    """bf16 logits tie often at the nucleus edge. A verification batch masks each row as plain sampling masks it
    alone: the same rule (tied tokens stay or go together) and the same path (the row's own, not the batch's:
    a flat row beside it needs the histogram, a peaked row alone reads its top 256)."""
    from spectot.spec.sampling import outside_nucleus

    gen = torch.Generator().manual_seed(5)
    vocab, rows = 2_000, 60
    logits = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().float()  # coarse: many exact ties
    flat = torch.zeros(1, vocab)  # its nucleus runs far past the first 256 tokens
    for top_p in (0.5, 0.9):
        probs = logits.softmax(-1)
        batched = outside_nucleus(torch.cat([probs, flat.softmax(-1)]), top_p)[:rows]
        alone = torch.cat([outside_nucleus(probs[r : r + 1], top_p) for r in range(rows)])
        assert torch.equal(batched, alone)
        for r in range(rows):  # ties at the edge: all kept or all dropped, and the kept mass reaches top_p
            kept = probs[r][~alone[r]]
            assert float(kept.sum()) >= top_p - 1e-6
            edge = float(kept.min())
            assert not bool(alone[r][probs[r] == edge].any())


def test_the_likeliest_tokens_stay_whatever_the_top_p() -> None:
    """A top_p of 1e-300 passes the > 0 check but is 0 in float32: every token was dropped, and sampling emitted
    token 0 at every step."""
    from spectot.spec.sampling import outside_nucleus

    assert outside_nucleus(torch.tensor([[0.5, 0.3, 0.2]]), 1e-300).tolist() == [[False, True, True]]
    assert outside_nucleus(torch.tensor([[0.4, 0.4, 0.2]]), 1e-300).tolist() == [[False, False, True]]  # tied: both


def test_the_histogram_path_keeps_the_same_nucleus_as_the_top_tokens() -> None:
    from spectot.spec.sampling import outside_nucleus

    gen = torch.Generator().manual_seed(6)
    probs = (torch.randn(20, 3_000, generator=gen) * 2).bfloat16().float().softmax(-1).double()
    for top_p in (0.3, 0.8, 0.95):
        assert torch.equal(outside_nucleus(probs, top_p, first=probs.shape[-1]), outside_nucleus(probs, top_p, first=8))
