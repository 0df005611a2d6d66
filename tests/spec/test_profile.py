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


def test_a_profile_of_one_point_is_refused(tmp_path) -> None:
    """Read as a flat curve, it priced every tree as free (n = 64 trees for 8 streams, a claimed 3.4x)."""
    import json

    from spectot.spec.profile import read_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"t_curve": [{"n": 1, "t": 1.0}]}))
    with pytest.raises(ValueError, match="one point says nothing about larger n"):
        read_profile(str(path))
    path.write_text(json.dumps({"t_curve": [{"n": 1, "t": 1.0}, {"n": 8, "t": 1.3}]}))
    assert read_profile(str(path))["t_curve"][1]["n"] == 8
