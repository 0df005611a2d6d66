"""`spec/profile.measure_t_curve`: the target's t(n) curve, sizes measured in turns."""

from __future__ import annotations

import pytest

from spectot.engine.runner import ModelRunner
from spectot.spec.profile import measure_t_curve


def test_t_curve_takes_the_sizes_in_turns_and_reports_each_relative_to_one(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(0), kernels="torch")
    seen = []
    forward = runner.forward

    def recording(trees, **kwargs):
        seen.append(len(trees[0].tree))
        return forward(trees, **kwargs)

    runner.forward = recording
    curve = measure_t_curve(runner, 0, prefix=8, reps=3, ns=(1, 2, 4))
    assert seen == [8] + [1, 2, 4] * 4  # the prefix, then a warm-up round and 3 timed rounds, sizes in turn
    assert [p["n"] for p in curve] == [1, 2, 4] and curve[0]["relative"] == 1.0
    assert all(p["seconds"] > 0 and p["relative"] == p["seconds"] / curve[0]["seconds"] for p in curve)
    assert runner.cache.used == 0  # its stream is released
    with pytest.raises(ValueError, match="starts at n = 1"):
        measure_t_curve(runner, 0, ns=(2, 4))
