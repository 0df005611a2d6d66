"""A draft decoder's propose time with its native calls and with the depth-by-depth loop, interleaved in one run.

The same GSM8K prompts decode with each path in turn (``runner.draft_chain`` declining, as where the native loop is
not built, gives the loop); prints the mean propose time of each path per round and whether every draft (tokens
and draft probabilities) and every output token were the same. Writes JSON.

    python scripts/native_draft_ab.py --tree pct --lookup 2 --temperature 1 --prompts 4 --rounds 2 --out runs/native_ab
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from spectot.config import DraftOptions, ModelOptions
from spectot.data.jsonl import read_field
from spectot.pipeline import Pipeline, make_proposer, measure_solve_costs, size_pct_trees
from spectot.spec.decoding import DecodeConfig
from spectot.spec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="edd")
    parser.add_argument("--tree", default="chain", help="chain or pct (sized by this machine's t(n))")
    parser.add_argument("--lookup", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--gsm8k", default="../shared/data/gsm8k/test.jsonl")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/native_ab")
    args = parser.parse_args()
    model = ModelOptions(threads=args.threads)
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    prompts = [pipe.encode(q) for q in read_field(args.gsm8k, "question", args.prompts)]
    sampling = SamplingParams.from_temperature(args.temperature)
    config = DecodeConfig(max_new_tokens=128, method="sd", num_draft_tokens=5, sampling=sampling, seed=0)
    options = DraftOptions(draft=args.draft, tree=args.tree, lookup=args.lookup)
    times: dict[str, list[float]] = {"native": [], "loop": []}
    outputs: dict[str, list] = {}
    costs = measure_solve_costs(pipe, make_proposer(options, pipe.target, model)) if args.tree == "pct" else {}
    for i in range(2 * args.rounds):
        path = ("native", "loop")[i % 2]
        proposer = make_proposer(options, pipe.target, model)
        if args.tree == "pct":
            size_pct_trees(proposer, costs)  # one t(n) for every round: the same trees
        if path == "loop":
            proposer.runner.draft_chain = lambda *a, **k: None  # as where the native loop is not built
        pipe.decoder.proposer = proposer
        propose, spent, drafts = proposer.propose, [0.0, 0], []

        def timed(*a, _propose=propose, _spent=spent, _drafts=drafts):  # noqa: ANN002, ANN202
            start = time.perf_counter()
            out = _propose(*a)
            _spent[0] += time.perf_counter() - start
            _spent[1] += 1
            _drafts += [(d.tokens.tolist(), [None if math.isnan(c) else c for c in d.confidence.tolist()]) for d in out]
            return out

        proposer.propose = timed
        pipe.decoder.generate([prompts[0][:24]], DecodeConfig(max_new_tokens=8, method="sd"))  # warm-up
        drafts.clear()
        spent[:] = [0.0, 0]
        tokens = [pipe.decoder.generate([p], config)[0].token_ids for p in prompts]
        times[path].append(1e3 * spent[0] / spent[1])
        outputs.setdefault(path, (tokens, drafts))
        print(f"round {i // 2 + 1} {path}: propose {times[path][-1]:.2f} ms")
    same = outputs["native"] == outputs["loop"]
    print(f"same drafts and tokens: {same}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "propose_ms": times, "same": same}, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
