"""Ops and time of one target forward on the runner's torch path (the one a GPU runs).

On a GPU a 135M model is bound by kernel launches, so the number of ops a forward issues is its cost; on
the CPU `native_attention=False` and `--kernels torch` run the same path. Prints the top-level aten ops of a
forward of 1 and 5 rows after a 256-token prefix, and the median time of 100 such forwards, for SmolLM2 and
for a 30-layer model with tiny matrices (whose time on the CPU is nearly all op overhead).

Usage: python scripts/runner_ops.py [--device cpu|cuda] [--dtype bf16|fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from spectot.engine.runner import ModelRunner, StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.models.loader import load_model, torch_dtype


def measure(model, label: str, device: str) -> None:
    runner = ModelRunner(model, kernels="torch", native_attention=False)
    sid = runner.new_stream()
    runner.forward([StreamTree(sid, TokenTree.chain([3 + t % 60 for t in range(256)]))])
    runner.commit_all()

    def step(rows: int) -> None:
        runner.forward([StreamTree(sid, TokenTree.chain(list(range(7, 7 + rows))))])
        runner.commit({})  # host logits: the forward has synchronised

    for rows in (1, 5):
        step(rows)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(rows)
        ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and not _under_aten(e))
        times = []
        for _ in range(100):
            t = time.perf_counter()
            step(rows)
            times.append(time.perf_counter() - t)
        print(f"{label} on {device}, {rows} row(s): {ops} aten ops, {1e3 * statistics.median(times):.2f} ms")


def _under_aten(event) -> bool:
    parent = event.cpu_parent
    return parent is not None and parent.name.startswith("aten::")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=30,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        tiny = LlamaForCausalLM(config).to(args.device, torch_dtype(args.dtype)).eval()
    measure(tiny, "30 tiny layers", args.device)
    measure(load_model("smollm2-135m", dtype=args.dtype, device=args.device).model, "SmolLM2-135M", args.device)


if __name__ == "__main__":
    main()
