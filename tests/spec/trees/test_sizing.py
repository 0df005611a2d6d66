"""Hardware-aware tree sizing: TCurve interpolation, the argmax of G / (t(B n) + (d - 1) c) on hand-made
tables and curves, and how the chosen tree shrinks as more streams share a forward."""

from __future__ import annotations

import json
import math

import pytest

from spectot.spec.trees.sequoia import sequoia_tree
from spectot.spec.trees.sizing import (
    TCurve,
    choose_tree_size,
    per_stream_budget,
    predicted_speedup,
    step_time,
)

ACCEPTANCE = [0.6, 0.15, 0.07, 0.04]
# relative target-forward times measured on the project's machine
MEASURED = {1: 1.0, 2: 1.05, 4: 1.12, 8: 1.45, 16: 2.42, 32: 5.84, 64: 8.74}


def measured_curve() -> TCurve:
    return TCurve.from_measurements(MEASURED)


def big_table() -> list[list[float]]:
    return sequoia_tree(ACCEPTANCE, 64, 12).table


def tiny_table() -> list[list[float]]:
    """G(n, d) for n, d <= 3 under acceptance (0.8, 0.1): G(2, 2) = 1.8, G(3, 2) = 1.9, G(3, 3) = 2.44."""
    return sequoia_tree([0.8, 0.1], 3, 3).table


def tiny_curve() -> TCurve:
    """t(1) = 1, t(2) = 1.2, t(4) = 2.0; so t(3) = 1.6 and t(6) = 2.8 (slope 0.4 past n = 4)."""
    return TCurve(((1, 1.0), (2, 1.2), (4, 2.0)))


# ---------------------------------------------------------------- TCurve


def test_interpolates_between_points() -> None:
    curve = measured_curve()
    assert curve(1) == 1.0
    assert curve(8) == pytest.approx(1.45)
    assert curve(3) == pytest.approx((1.05 + 1.12) / 2)
    assert curve(6) == pytest.approx(1.12 + (1.45 - 1.12) / 2)
    assert curve(24) == pytest.approx((2.42 + 5.84) / 2)


def test_extrapolates_with_the_last_slope_or_the_average_one_whichever_is_steeper() -> None:
    curve = measured_curve()
    average = (8.74 - 1.0) / 63  # steeper than the last segment's (8.74 - 5.84) / 32
    assert curve(128) == pytest.approx(8.74 + average * 64)
    assert curve(65) == pytest.approx(8.74 + average)
    steep = TCurve(((1, 1.0), (2, 1.1), (4, 3.0)))  # the last segment's slope 0.95 beats the average 0.67
    assert steep(6) == pytest.approx(3.0 + 0.95 * 2)


def test_a_dip_is_lifted_and_never_makes_larger_forwards_free() -> None:
    """Noise made t(64) a hair below t(32): read as it was, every forward past 32 rows cost t(32) (a 64-stream
    tree went from 2 nodes to 32 on a 2 % difference)."""
    falling = TCurve(((1, 1.0), (2, 2.0), (4, 1.8)))
    assert falling(3) == pytest.approx(2.0) and falling(4) == pytest.approx(2.0)  # the running maximum
    assert falling(100) == pytest.approx(2.0 + (2.0 - 1.0) / 3 * 96)  # grows at the average slope
    assert falling.points == ((1, 1.0), (2, 2.0), (4, 1.8))  # the measurements are kept as they were
    dip = TCurve(((1, 1.0), (32, 1.2), (64, 1.19)))
    assert dip(2048) > dip(64) + 1.0
    assert TCurve(((1, 1.0),))(1000) == 1.0


def test_from_measurements_normalises_and_sorts() -> None:
    records = [{"n": 4, "t": 24.0}, {"n": 1, "t": 20.0}, {"n": 2, "t": 21.0}]
    curve = TCurve.from_measurements(records)
    assert curve.points == ((1, 1.0), (2, 1.05), (4, 1.2))
    string_keys = TCurve.from_measurements({"1": 20.0, "2": 21.0, "4": 24.0})
    assert string_keys == curve


def test_json_round_trip() -> None:
    curve = measured_curve()
    assert TCurve.from_json(json.dumps(curve.to_records())) == curve
    assert TCurve.from_json(json.dumps({"1": 10, "8": 14.5}))(8) == pytest.approx(1.45)


@pytest.mark.parametrize(
    "points, message",
    [
        ((), "at least"),
        (((2, 1.0), (4, 1.5)), "start at"),
        (((1, 2.0), (2, 3.0)), "start at"),
        (((1, 1.0), (4, 2.0), (2, 1.5)), "strictly increasing"),
        (((1, 1.0), (2, 1.5), (2, 1.6)), "strictly increasing"),
        (((1, 1.0), (2, 0.0)), "positive"),
        (((1, 1.0), (2, -1.0)), "positive"),
        (((1, 1.0), (2, math.nan)), "positive"),
        (((0, 1.0), (2, 1.5)), "positive integer"),
        (((1, 1.0), (2.5, 1.5)), "positive integer"),
    ],
)
def test_bad_points_raise(points: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TCurve(points)


def test_bad_measurements_raise() -> None:
    with pytest.raises(ValueError, match="measure t\\(1\\)"):
        TCurve.from_measurements({2: 1.0, 4: 1.5})
    with pytest.raises(ValueError, match="positive integer"):
        TCurve.from_measurements({"1": 1.0, "1.5": 1.2})
    with pytest.raises(ValueError, match="must be"):
        TCurve.from_measurements([{"n": 1, "time": 1.0}])
    with pytest.raises(ValueError, match="t must be a number"):
        TCurve.from_measurements({1: "fast"})
    with pytest.raises(ValueError, match="n >= 1"):
        measured_curve()(0.5)


# ---------------------------------------------------------------- choice of (n, d)


def test_flat_curve_free_drafts_pick_the_largest_tree() -> None:
    table = big_table()
    choice = choose_tree_size(table, TCurve(((1, 1.0),)), draft_cost=0.0)
    assert choice.n == 64
    assert choice.tokens_per_step == pytest.approx(max(max(row) for row in table))
    assert choice.speedup_vs_ar == pytest.approx(choice.tokens_per_step)


def test_draft_cost_trades_depth_for_speed() -> None:
    table = big_table()
    free = choose_tree_size(table, TCurve(((1, 1.0),)), draft_cost=0.0)
    costly = choose_tree_size(table, TCurve(((1, 1.0),)), draft_cost=0.3)
    assert costly.d < free.d
    assert costly.speedup_vs_ar == pytest.approx(costly.tokens_per_step / (1.0 + (costly.d - 1) * 0.3))


def test_linear_curve_makes_plain_decoding_win() -> None:
    # t(n) = n: G(n, d) <= 1 + (n - 1) p_1 < n for every tree, so no tree beats one token per forward
    linear = TCurve(((1, 1.0), (2, 2.0)))
    choice = choose_tree_size(big_table(), linear, draft_cost=0.0)
    assert (choice.n, choice.d) == (1, 1)
    assert choice.speedup_vs_ar == 1.0


@pytest.mark.parametrize("p1, expected_n", [(0.6, 2), (0.4, 1)])
def test_steep_curve_small_chain_depends_on_acceptance(p1: float, expected_n: int) -> None:
    # t(2) = 1.5, linear after: n = 2 wins iff (1 + p1) / 1.5 > 1; n >= 3 costs t(n) >= 2.75 > G
    steep = TCurve(((1, 1.0), (2, 1.5), (4, 4.0)))
    choice = choose_tree_size(sequoia_tree([p1, 0.1], 16, 8).table, steep, draft_cost=0.0)
    assert (choice.n, choice.d) == (expected_n, expected_n)


def test_hand_computed_tiny_table() -> None:
    table = tiny_table()
    assert table[2][2] == pytest.approx(1.8) and table[3][2] == pytest.approx(1.9)
    assert table[3][3] == pytest.approx(2.44)
    choice = choose_tree_size(table, tiny_curve(), draft_cost=0.1)
    grid = choice.speedup_grid
    assert grid[1][1] == 1.0
    assert grid[1][2] == pytest.approx(1 / 1.1)
    assert grid[2][1] == 0.0 and grid[3][1] == 0.0  # no tree of 2 or 3 nodes has depth 1
    assert grid[2][2] == pytest.approx(1.8 / 1.3)
    assert grid[3][2] == pytest.approx(1.9 / 1.7)
    assert grid[3][3] == pytest.approx(2.44 / 1.8)
    assert (choice.n, choice.d) == (2, 2)
    assert choice.step_time == pytest.approx(1.3)
    assert choice.speed == pytest.approx(1.8 / 1.3)
    assert choice.speedup_vs_ar == pytest.approx(1.8 / 1.3)


def test_hand_computed_streams() -> None:
    table = tiny_table()
    two = choose_tree_size(table, tiny_curve(), draft_cost=0.1, streams=2)
    # forward over 2 * 2 = 4 tokens: t(4) = 2.0; AR of 2 streams costs t(2) = 1.2
    assert (two.n, two.d) == (2, 2)
    assert two.step_time == pytest.approx(2.1)
    assert two.speed == pytest.approx(1.8 / 2.1)
    assert two.speedup_vs_ar == pytest.approx(1.8 * 1.2 / 2.1)
    assert two.speedup_grid[3][3] == pytest.approx(2.44 * 1.2 / (2.8 + 0.2))
    # 3 streams: the best tree, (2, 2), gives 1.8 * 1.6 / (2.8 + 0.1) = 0.993 < 1: plain decoding wins
    three = choose_tree_size(table, tiny_curve(), draft_cost=0.1, streams=3)
    assert three.speedup_grid[2][2] == pytest.approx(1.8 * 1.6 / 2.9)
    assert (three.n, three.d) == (1, 1)
    assert three.step_time == pytest.approx(1.6)


def test_max_nodes_caps_the_tree() -> None:
    flat = TCurve(((1, 1.0),))
    choice = choose_tree_size(big_table(), flat, draft_cost=0.0, max_nodes=10)
    assert choice.n == 10
    assert all(v == 0.0 for row in choice.speedup_grid[11:] for v in row)


def test_choice_is_the_grid_maximum_and_matches_predicted_speedup() -> None:
    table = big_table()
    curve = measured_curve()
    for streams in (1, 4):
        choice = choose_tree_size(table, curve, draft_cost=0.05, streams=streams)
        assert choice.speedup_vs_ar == max(max(row) for row in choice.speedup_grid)
        again = predicted_speedup(choice.tokens_per_step, choice.n, choice.d, curve, 0.05, streams)
        assert again == pytest.approx(choice.speedup_vs_ar)
        assert choice.speedup_vs_ar == pytest.approx(choice.speed * curve(streams))


def test_a_first_draft_forward_that_catches_up_is_charged_once() -> None:
    """c_1 + (d - 2) c: the step's first draft forward (catch-up + one depth) costs c_1, each further one c."""
    curve = TCurve(((1, 1.0), (64, 1.0)))
    assert step_time(5, 1, curve, 0.1, first_draft_cost=0.4) == 1.0  # no draft forward
    assert step_time(5, 2, curve, 0.1, first_draft_cost=0.4) == pytest.approx(1.4)
    assert step_time(5, 4, curve, 0.1, first_draft_cost=0.4) == pytest.approx(1.6)
    assert step_time(5, 4, curve, 0.1) == pytest.approx(1.3)  # every forward c
    table = sequoia_tree([0.55, 0.15, 0.07], 16, 8).table
    cheap_first = choose_tree_size(table, curve, 0.12)
    dear_first = choose_tree_size(table, curve, 0.12, first_draft_cost=0.45)
    assert dear_first.step_time == pytest.approx(1.0 + 0.45 + (dear_first.d - 2) * 0.12)
    assert dear_first.speedup_vs_ar < cheap_first.speedup_vs_ar


def test_callable_draft_cost_sees_the_stream_count() -> None:
    seen = []

    def cost(rows: int) -> float:
        seen.append(rows)
        return 0.02 * rows

    assert step_time(4, 3, measured_curve(), cost, streams=8) == pytest.approx(measured_curve()(32) + 2 * 0.16)
    assert set(seen) == {8}


# ---------------------------------------------------------------- streams


def test_tree_per_stream_shrinks_as_streams_grow() -> None:
    budgets = per_stream_budget(big_table(), measured_curve(), 0.05, [1, 2, 4, 8, 16])
    sizes = [budgets[b].n for b in (1, 2, 4, 8, 16)]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert sizes[0] > sizes[-1] == 1
    assert all(budgets[b].streams == b for b in budgets)
    # a costlier first draft forward (it catches up) reaches every B's choice, as choose_tree_size's own
    costly = per_stream_budget(big_table(), measured_curve(), 0.05, [1, 4], first_draft_cost=0.5)
    assert costly[4] == choose_tree_size(big_table(), measured_curve(), 0.05, 4, first_draft_cost=0.5)
    assert costly[1].step_time > budgets[1].step_time


def test_measured_kink_past_32_tokens_is_followed() -> None:
    # t(64) / t(32) = 1.50 < G(2, 2) = 1.6: at 32 streams a 2-node tree per stream pays off again,
    # because the measured curve grows slower between 32 and 64 tokens than between 16 and 32
    choice = choose_tree_size(big_table(), measured_curve(), draft_cost=0.05, streams=32)
    assert (choice.n, choice.d) == (2, 2)
    assert choice.speedup_vs_ar == pytest.approx(1.6 * 5.84 / (8.74 + 0.05))


def test_bad_sizing_inputs_raise() -> None:
    table, curve = tiny_table(), tiny_curve()
    with pytest.raises(ValueError, match="streams"):
        choose_tree_size(table, curve, 0.1, streams=0)
    with pytest.raises(ValueError, match="max_nodes"):
        choose_tree_size(table, curve, 0.1, max_nodes=0)
    with pytest.raises(ValueError, match="draft step cost"):
        choose_tree_size(table, curve, -0.1)
    with pytest.raises(ValueError, match="draft step cost"):
        choose_tree_size(table, curve, lambda rows: math.inf)
    with pytest.raises(ValueError, match="rectangular"):
        choose_tree_size([[0.0]], curve, 0.1)
    with pytest.raises(ValueError, match="G\\(1, 1\\)"):
        choose_tree_size([[0.0, 0.0], [0.0, 2.0]], curve, 0.1)
