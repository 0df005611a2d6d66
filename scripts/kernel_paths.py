"""One target forward over n rows through each bf16 matmul path, interleaved in one run.

Paths: torch's ``F.linear`` (oneDNN; AMX where the CPU has it), spectot's vdpbf16ps lanes (AVX512-BF16) and
spectot's AMX tiles (where the CPU has AMX). Each repetition runs every (n, path) once, in turn, so a slow
phase of a shared machine hits every path alike; the table shows medians. Writes JSON and Markdown.

    python scripts/kernel_paths.py --rows 1,2,4,8,16,32,64 --reps 7 --out runs/kernel_paths
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spectot.engine.kernels import bf16_linear
from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/kernel_paths")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(n) for n in args.rows.split(",")]
    module = bf16_linear()
    target = load_model(args.target, dtype="bf16", device="cpu")

    def runner(kernels: str, amx_rows: int | None = None) -> ModelRunner:
        made = ModelRunner(target.model, max_context=target.max_context, kernels=kernels)
        if amx_rows is not None:
            made._linear.amx_rows = amx_rows  # the packed panels serve both spectot paths
        return made

    runners = {"torch (oneDNN, torch's ops)": runner("torch")}
    if module is not None:
        runners["spectot lanes (vdpbf16ps or AVX2)"] = runner("spectot", amx_rows=2**62)
        if module.amx():
            runners["spectot AMX tiles"] = runner("spectot", amx_rows=1)
    streams = {}
    for name, each in runners.items():
        streams[name] = each.new_stream()
        context = TokenTree.chain(list(range(100, 100 + args.context)))
        each.forward([StreamTree(streams[name], context)], last_only=True)
        each.commit_all()
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.reps + 1):  # the first repetition warms up
        for n in rows:
            for name, each in runners.items():
                tree = TokenTree.chain(list(range(5, 5 + n)))
                start = time.perf_counter()
                each.forward([StreamTree(streams[name], tree)])
                each.commit({})
                times.setdefault((name, n), []).append(time.perf_counter() - start)
    table = {name: {n: 1e3 * statistics.median(times[name, n][1:]) for n in rows} for name in runners}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "ms": table}, indent=1))
    lines = [
        f"One {args.target} bf16 forward over n rows at a {args.context}-token context, ms "
        f"(median of {args.reps}, paths interleaved, {args.threads} threads)",
        "",
        "| path | " + " | ".join(str(n) for n in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    lines += [f"| {name} | " + " | ".join(f"{table[name][n]:.1f}" for n in rows) + " |" for name in runners]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
