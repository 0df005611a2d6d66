"""SPEX's ceiling for BFS searches over a grid of k_total and lookahead: a `bench spex` run's plain trees
replayed at the reward barriers and with perfect speculation (`explore/bound.py`), on a measured throughput
curve ("here") and with free concurrency ("free").

`bench spex` writes the ceiling of its own k_total and lookahead only, and only when it measured the curve
(a run with --fixed-k-total does not). This script reads the plain trees of one run and the curve of the same
or another run (the `("concurrency",)` record of a `bench spex` without --fixed-k-total), so one curve serves
every run on the machine. One row per task, search, in-flight count, over all of the cell's chunks.

Usage: python scripts/spex_ceiling.py RUN_DIR [--curve CURVE_RUN_DIR] [--k-total 2,4,8,16] [--lookahead 1,2,4]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from spectot.bench.spex import BFS, machine_ceiling


def records(run: Path) -> list[tuple[list, dict]]:
    lines = (run / "records.jsonl").read_text().splitlines()
    return [(r["key"], r["value"]) for r in map(json.loads, lines) if r.get("key") is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a `spectot bench spex --out` folder with plain BFS rows")
    parser.add_argument("--curve", type=Path, help="the folder whose throughput curve to use (default: RUN)")
    parser.add_argument("--k-total", default="2,4,8,16")
    parser.add_argument("--lookahead", default="1,2,4")
    args = parser.parse_args()
    curves = [v for k, v in records(args.curve or args.run) if k == ["concurrency"]]
    if not curves:
        parser.error(f"{args.curve or args.run}: no throughput curve; pass --curve with a run that measured one")
    free = {"concurrency": [1, 1 << 20], "tokens_per_second": [1.0, float(1 << 20)]}  # T(n) = n: solo speed each
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for key, value in records(args.run):
        if len(key) == 5 and key[1] in BFS and key[3] == "plain":
            cells[tuple(key[:3])].append(value)
    if not cells:
        parser.error(f"{args.run}: no plain REBASE / ETS chunks")
    grid = [(int(k), int(ahead)) for k in args.k_total.split(",") for ahead in args.lookahead.split(",")]
    print("| task | search | in flight | curve | " + " | ".join(f"k {k} / L {ahead}" for k, ahead in grid) + " |")
    print("|---|---|---|---|" + "---|" * len(grid))
    for (task, search, in_flight), chunks in sorted(cells.items()):
        for name, curve in (("here", curves[0]), ("free", free)):
            ceilings = [machine_ceiling(chunks, curve, in_flight, k, ahead) for k, ahead in grid]
            cols = " | ".join("-" if c is None else f"{c:.2f}" for c in ceilings)
            print(f"| {task} | {search} | {in_flight} | {name} | {cols} |")


if __name__ == "__main__":
    main()
