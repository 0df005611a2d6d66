"""Measuring this machine's costs for Sequoia's hardware-aware sizing: t(n) and the draft step cost c.

t(n): median seconds of one target forward over a chain of n new tokens (all logits) after a fixed
prefix, relative to n = 1. c: one draft call (catch up one committed entry and draft depth 1) over
one target step; ``c_extra_depth``: each further depth of a chain over one target step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.spec.proposers.base import DraftRequest, Proposer
from spectot.spec.sampling import SamplingParams


# The forward sizes a quick t(n) samples: every n up to 8, where the kernels change tiles (spectot's AVX2 and
# AVX512-BF16 linears take rows 6 at a time: t(6) and t(7) sit on either side of a step that powers of two and
# linear interpolation between t(4) and t(8) miss), then powers of two and their midpoints.
T_CURVE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)


def measure_t_curve(
    runner: ModelRunner, n_max: int, prefix: int = 128, reps: int = 5, ns: Sequence[int] | None = None
) -> list[dict]:
    """[{n, seconds, relative}] for n = 1..n_max (or the given ``ns``, which must start at 1): the median of
    ``reps`` timed forwards per n after one warm-up round. The sizes take turns within each round, so a machine
    whose speed drifts for a few seconds slows every n alike: measured n by n on a 2-core Xeon, one slow phase
    gave t(4) = 1.64 > t(8) = 1.42, and PCT sized its trees by that (EDD + PCT + lookup 2.66 tokens a step
    against 3.07 in the run before)."""
    ns = list(range(1, n_max + 1)) if ns is None else list(ns)
    if not ns or ns[0] != 1:
        raise ValueError(f"the t(n) curve starts at n = 1, got {ns}")
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model.config.vocab_size
    sid = runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain(torch.randint(vocab, (prefix,), generator=gen)))], last_only=True)
    runner.commit_all()
    times: dict[int, list[float]] = {n: [] for n in ns}
    for _ in range(reps + 1):  # the first round is the warm-up
        for n in ns:
            tree = TokenTree.chain(torch.randint(vocab, (n,), generator=gen))
            t = time.perf_counter()
            runner.forward([StreamTree(sid, tree)])
            runner.commit({})
            times[n].append(time.perf_counter() - t)
    curve = [{"n": n, "seconds": statistics.median(times[n][1:])} for n in ns]  # reps 2: the mean, not the larger
    runner.release(sid)
    for point in curve:
        point["relative"] = point["seconds"] / curve[0]["seconds"]
    return curve


def measure_costs(
    runner: ModelRunner,
    proposer: Proposer | None,
    n_max: int = 64,
    depths: int = 8,
    prefix: int = 128,
    reps: int = 5,
    ns: Sequence[int] | None = None,
) -> dict:
    """{"t_curve": [{n, t, seconds}], and with a draft: c, c_extra_depth, the seconds they come from}."""
    if depths < 2:
        raise ValueError(f"the draft's cost per depth is timed over chains of depths 1 and {depths}: need >= 2")
    curve = measure_t_curve(runner, n_max, prefix=prefix, reps=reps, ns=ns)
    result = {"t_curve": [{"n": p["n"], "t": p["relative"], "seconds": p["seconds"]} for p in curve]}
    if proposer is None:
        return result
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(int(runner.model.config.vocab_size), (prefix,), generator=gen)
    hidden_layer = getattr(proposer, "hidden_layer", None)
    width = int(runner.model.config.hidden_size)
    times = {}
    for k in (1, depths):
        samples = []
        for rep in range(reps + 1):
            key = 10_000 + rep  # a fresh stream each time: every call catches up one new entry
            hidden = None if hidden_layer is None else torch.zeros(prefix - 1, width, device=runner.device)
            proposer.propose([DraftRequest(key, tokens, k, hidden)], SamplingParams(), None)  # catch up the prefix
            request = DraftRequest(
                key,
                torch.cat([tokens, tokens[:1]]),
                k,
                None if hidden is None else torch.zeros(1, width, device=runner.device),
            )
            t = time.perf_counter()
            proposer.propose([request], SamplingParams(), None)
            samples.append(time.perf_counter() - t)
            proposer.release(key)
        times[k] = statistics.median(samples[1:])
    # one more depth of a chain; a draft whose cost does not grow with depth (n-gram) times noise: clamped at 0
    step = max(0.0, (times[depths] - times[1]) / (depths - 1))
    t1 = curve[0]["seconds"]
    result.update(
        draft_first_step_s=times[1], draft_step_s=step, target_step_s=t1, c=times[1] / t1, c_extra_depth=step / t1
    )
    return result


def read_profile(path: str, need_draft: bool = False) -> dict:
    """A `spectot tree profile` JSON, checked before any model loads: {"t_curve": [{n, t, seconds?}, ...] with
    n = 1 first, and ``c`` / ``c_extra_depth`` (the draft step costs) where ``need_draft``}; anything else is a
    ValueError naming the file and what is wrong."""
    import json
    from pathlib import Path

    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read it as the JSON `spectot tree profile` writes ({err})") from None
    curve = profile.get("t_curve") if isinstance(profile, dict) else None
    if not isinstance(curve, list) or not curve:
        raise ValueError(f"{path}: not a `spectot tree profile` JSON (an object with a 't_curve' list)")
    for i, point in enumerate(curve):
        if not (
            isinstance(point, dict) and isinstance(point.get("n"), int) and isinstance(point.get("t"), int | float)
        ):
            raise ValueError(f"{path}: t_curve[{i}] is not a point {{n, t}}: {point!r}")
    if curve[0]["n"] != 1:
        raise ValueError(f"{path}: the t_curve must start at n = 1 (t(n) is relative to one row)")
    if len(curve) < 2:  # read as flat, every tree size would cost one row's time
        raise ValueError(f"{path}: a t_curve of one point says nothing about larger n; measure it at n > 1 too")
    for key in ("c", "c_extra_depth") if need_draft else ():
        if not isinstance(profile.get(key), int | float):
            raise ValueError(f"{path}: no draft cost '{key}': profile with the draft (`spectot tree profile --draft`)")
    return profile
