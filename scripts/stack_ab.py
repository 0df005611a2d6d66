"""One SmolLM2 forward over n rows through the native layer loop (``decoder_stack.cpp``) as it is and as it was at a
git revision, alternating in one process, with equal logits asserted at every step.

The old sources (the whole kernels folder at the revision) are built under another module name in a scratch folder
and a second runner is built over them; both runners hold the same context and take each (n, build) in turn, in
alternating order, so a slow phase of a shared machine hits both alike. Prints medians and writes JSON.

    python scripts/stack_ab.py --before 4995680 --rows 1,2,4,6,8 --reps 30 --out runs/stack_ab
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

import spectot.engine.kernels as kernels
from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.models.loader import load_model

KERNELS = "src/spectot/engine/kernels"
AVX512_BF16 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


def build_old(revision: str, folder: Path) -> object:
    """The layer loop's module at ``revision``, its class registered module-locally (two modules define it)."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{revision}:{KERNELS}"], check=True, capture_output=True, text=True
    ).stdout.split()
    for name in names:
        if name.endswith((".cpp", ".h")):
            text = subprocess.run(
                ["git", "show", f"{revision}:{KERNELS}/{name}"], check=True, capture_output=True, text=True
            ).stdout
            if name == "decoder_stack.cpp":
                text = text.replace(
                    'py::class_<DecoderStack>(m, "DecoderStack")',
                    'py::class_<DecoderStack>(m, "DecoderStack", py::module_local())',
                )
            (folder / name).write_text(text)
    isa = AVX512_BF16 if kernels.cpu_has("avx512_bf16") else []  # the build the product makes on this CPU (no AMX)
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", *isa]
    return load(name="spectot_decoder_stack_before", sources=[str(folder / "decoder_stack.cpp")],
                extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the layer loop to compare against")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the KV cache")
    parser.add_argument("--rows", default="1,2,4,6,8")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/stack_ab")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.target, dtype="bf16").model
    runners = {"after": ModelRunner(model)}
    with tempfile.TemporaryDirectory() as scratch:
        old = build_old(args.before, Path(scratch))
        built = kernels.decoder_stack
        kernels.decoder_stack = lambda: old  # the second runner's loop: the old build
        try:
            runners["before"] = ModelRunner(model)
        finally:
            kernels.decoder_stack = built
    if any(r._stack is None for r in runners.values()):
        raise SystemExit("the native layer loop does not apply here (needs bf16 on an x86 CPU with AVX2)")
    streams = {}
    for name, runner in runners.items():
        streams[name] = runner.new_stream()
        prefix = [3 + t % 60 for t in range(args.context)]
        runner.forward([StreamTree(streams[name], TokenTree.chain(prefix))])
        runner.commit_all()
    rows = [int(n) for n in args.rows.split(",")]
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in runners}
    for rep in range(args.reps):
        for n in rows:
            logits = {}
            for name in sorted(runners, reverse=rep % 2 == 1):
                runner = runners[name]
                start = time.perf_counter()
                out = runner.forward([StreamTree(streams[name], TokenTree.chain(list(range(7, 7 + n))))])
                runner.commit({})  # host logits: the forward has finished
                times[name][n].append(time.perf_counter() - start)
                logits[name] = out.logits[0]
            if not torch.equal(logits["before"], logits["after"]):
                raise SystemExit(f"the two loops' logits differ at {n} rows")
    result = {"before": args.before, "context": args.context, "reps": args.reps, "rows": {}}
    for n in rows:
        before, after = (statistics.median(times[name][n]) * 1e3 for name in ("before", "after"))
        result["rows"][n] = {"before_ms": before, "after_ms": after}
        print(f"{n:3d} rows: before {before:6.2f} ms  after {after:6.2f} ms  ({after / before:.3f})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stack_ab.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
