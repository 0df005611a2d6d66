"""The linears of one SmolLM2 forward (270 MB of bf16 weights, streamed from DRAM) over n rows, through
``bf16_linear.cpp`` as it is and as it was at a git revision, interleaved in one process. ``--weights draft``:
instead the linears of one forward of the shipped one-layer EDD (its layer and a 2,048-row head, 9.4 MB), 20
times over, so from cache, as the draft's depths after the first read them.

Both sources are built under their own module names in a scratch folder; each round runs every (n, build) once,
in alternating order, so a slow phase of a shared machine hits both alike; prints medians and writes JSON.

    python scripts/linear_ab.py --before 9678a22 --rows 1,6,7,8,10,12,16,24,32 --rounds 9 --out runs/linear_ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from spectot.engine.kernels import cpu_has

KERNELS = Path(__file__).resolve().parents[1] / "src/spectot/engine/kernels"
AVX512_BF16 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
# SmolLM2-135M: 30 layers of (q|k|v, o, gate|up, down), then the tied LM head
SHAPES = {
    "target": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)],
    "draft": [(960, 576), (576, 576), (3072, 576), (576, 1536), (2048, 576)],
}
REPEATS = {"target": 1, "draft": 20}  # forwards per timing


def build(name: str, source: str, folder: Path) -> object:
    (folder / "vec.h").write_text((KERNELS / "vec.h").read_text())
    (folder / f"{name}.cpp").write_text(source)
    isa = AVX512_BF16 if cpu_has("avx512_bf16") else []  # the build the product makes on this CPU (no AMX here)
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", *isa]
    return load(name=name, sources=[str(folder / f"{name}.cpp")], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(folder), verbose=False)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the kernel to compare against")
    parser.add_argument("--rows", default="1,6,7,8,10,12,16,24,32")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", choices=sorted(SHAPES), default="target")
    parser.add_argument("--out", default="runs/linear_ab")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    old = subprocess.run(
        ["git", "show", f"{args.before}:src/spectot/engine/kernels/bf16_linear.cpp"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    scratch = Path(tempfile.mkdtemp(prefix="linear_ab_"))  # sources and builds, not the results
    builds = {
        "before": build("linear_ab_before", old, scratch),
        "after": build("linear_ab_after", (KERNELS / "bf16_linear.cpp").read_text(), scratch),
    }
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen).bfloat16(), n, k) for n, k in SHAPES[args.weights]]
    packed = {name: [(m.pack(w), n, k) for w, n, k in weights] for name, m in builds.items()}

    def forward(name: str, rows: int) -> float:
        x = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
        t = time.perf_counter()
        for _ in range(REPEATS[args.weights]):
            for w, n, k in packed[name]:
                builds[name].linear(x[k], w, None, n, 1 << 30)
        return (time.perf_counter() - t) / REPEATS[args.weights]

    rows = [int(r) for r in args.rows.split(",")]
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in builds}
    for i in range(args.rounds + 1):  # the first round warms up
        for n in rows:
            for name in ("before", "after") if i % 2 else ("after", "before"):
                forward(name, n)
                seconds = forward(name, n)
                if i:
                    times[name][n].append(seconds)
    result = {name: {n: statistics.median(v) for n, v in by_rows.items()} for name, by_rows in times.items()}
    (out / "results.json").write_text(
        json.dumps({"before": args.before, "threads": args.threads, "weights": args.weights, **result}, indent=1)
    )
    for n in rows:
        before, after = result["before"][n], result["after"][n]
        print(f"{n:3d} rows: before {before * 1e3:7.3f} ms  after {after * 1e3:7.3f} ms  ({after / before:.3f})")


if __name__ == "__main__":
    main()
