"""SPEX's inter-query budget: softmax allocation capped by capacity, and k_total read off a throughput curve."""

from __future__ import annotations

import pytest

from spectot.explore.budget import allocate, k_total_from_curve


def test_allocation_worked_example() -> None:
    # score = C P (S_w + S_KV) = [4, 1]; softmax = [0.9526, 0.0474]; floor(8 x) = [7, 0]; the unit left goes to
    # the larger remainder (0.62 against 0.38)
    assert allocate(8, [8, 2], [0.5, 0.5], 0.0, [1.0, 1.0]) == [8, 0]
    assert allocate(8, [7, 2], [0.5, 0.5], 0.0, [1.0, 1.0]) == [7, 1]  # query 0 is full: the unit goes on


def test_the_floors_never_leave_usable_budget_idle() -> None:
    assert allocate(2, [3, 3, 3], [0.5, 0.5, 0.5], 1.0, [0.5, 0.5, 0.5]) == [1, 1, 0]  # floors alone: [0, 0, 0]
    assert allocate(2, [3, 3, 3], [0.1, 0.9, 0.5], 1.0, [0.5, 0.5, 0.5], tau=3.0) == [
        0,
        2,
        0,
    ]  # softmax 2 x [0, .995, .004]


def test_allocation_caps_at_capacity_and_never_exceeds_k_total() -> None:
    k = allocate(16, [2, 9, 9], [0.9, 0.1, 0.1], 0.5, [0.5, 0.5, 0.5], tau=5.0)
    # score = [1.8, 0.9, 0.9]; softmax(5 score) = [.978, .011, .011]: query 0 would get 15 but can use 2; the
    # other two share the 14 it cannot use
    assert k == [2, 7, 7]
    for tau in (0.0, 0.3, 1.0, 10.0):
        capacity = [5, 7, 3, 11]
        for k_total in (0, 1, 3, 20, 40):
            k = allocate(k_total, capacity, [0.2, 0.6, 0.9, 0.4], [0.1, 0.3, 0.0, 0.2], [0.4, 0.1, 0.8, 0.3], tau)
            assert sum(k) == min(k_total, sum(capacity))  # all of the budget some query can use, no more
            assert all(0 <= kq <= cap for kq, cap in zip(k, capacity))


def test_a_negative_or_non_finite_tau_is_refused() -> None:
    for tau in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tau must be a finite number >= 0"):
            allocate(4, [2, 2], [0.5, 0.5], 0.0, [1.0, 1.0], tau)


def test_inputs_that_overflow_or_are_not_numbers_are_refused() -> None:
    """NaN hit rates or an overflowing tau * score failed inside math.floor ('cannot convert float NaN')."""
    with pytest.raises(ValueError, match="tau \\* score overflows"):
        allocate(4, [3, 3], [0.5, 0.5], 1.0, [0.5, 0.5], tau=1e308)
    for hit, kv in (([float("nan"), 0.5], [0.5, 0.5]), ([0.5, 0.5], [float("inf"), 0.5])):
        with pytest.raises(ValueError, match="must be finite numbers >= 0"):
            allocate(4, [3, 3], hit, 1.0, kv)


def test_tau_zero_splits_evenly() -> None:
    assert allocate(12, [10, 10, 10], [0.1, 0.5, 0.9], 0.2, [0.0, 0.3, 0.6], tau=0.0) == [4, 4, 4]


def test_allocation_edge_cases() -> None:
    assert allocate(8, [], [], 0.0, []) == []
    assert allocate(0, [3, 3], [1.0, 1.0], 1.0, [1.0, 1.0]) == [0, 0]
    with pytest.raises(ValueError, match="one value per query"):
        allocate(8, [1, 2], [0.5], 0.0, [1.0, 1.0])
    with pytest.raises(ValueError, match="reusable_weight"):
        allocate(8, [1, 2], [0.5, 0.5], [0.1], [1.0, 1.0])


def test_k_total_where_requests_stop_running_at_solo_speed() -> None:
    concurrency = [1, 2, 4, 8, 16, 32]
    # latency c T_1 / T_c: 1, 1.05, 1.14, 1.33, 2.62, 5.29
    assert k_total_from_curve(concurrency, [10.0, 19.0, 35.0, 60.0, 61.0, 60.5]) == 8
    assert k_total_from_curve(concurrency, [10.0, 19.0, 35.0, 60.0, 61.0, 60.5], slack=0.1) == 2
    # a later recovery does not count: 8 already ran at 2.4x solo latency
    assert k_total_from_curve(concurrency, [10.0, 19.0, 35.0, 33.0, 160.0, 320.0]) == 4
    assert k_total_from_curve(concurrency, [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]) == 32  # linear: never saturates
    assert k_total_from_curve([4], [7.0]) == 4
    # this machine (SmolLM2-135M bf16, 2 cores): latency 1.29 at 4, 1.74 at 8
    assert k_total_from_curve(concurrency, [20.0, 36.0, 62.0, 92.0, 102.0, 113.0]) == 4


def test_k_total_rejects_bad_curves() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        k_total_from_curve([1, 4, 2], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="matching"):
        k_total_from_curve([1, 2], [1.0])
    with pytest.raises(ValueError, match="positive"):
        k_total_from_curve([1, 2], [1.0, 0.0])
