"""SPEX's BFS ceiling measured in the engine itself: a perfect speculator against plain and SPEX on the same questions.

`scripts/spex_ceiling.py` replays plain trees on a throughput curve and leaves out what the curve does not hold
(prompt prefill, the explorer, the scheduler). Here each question is searched in turn by:
  plain   REBASE / ETS at the reward barriers; its tree (every expansion's key) is recorded;
  spex    the product's explorer (the width rule over the finished siblings, `explorer.py`), without retraction;
  spex-retract  the same with retraction (`--retract`; the product's default);
  oracle  the same explorer but told plain's tree: it speculates exactly the children plain expanded, each
          as soon as its parent has finished (up to `--lookahead` layers ahead, within k_total), and nothing
          else: hit rate 1, no waste. Its time is the most any BFS speculator gains on this engine.
The variants take turns on chunks of questions (the machine drifts); each chunk starts with a cold prefix cache.
The answers of every variant must be plain's (the search is exact); the script checks it.

Usage: python scripts/spex_oracle.py --problems 40 --task gsm8k --data ../shared/data/gsm8k/test.jsonl
    [--budget 4] [--k-total 8] [--lookahead 1,2] [--retract] [--search rebase] [--chunk 10] --out DIR
Writes DIR/records.jsonl (one line a question and variant; a rerun skips what is there) and DIR/summary.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from spectot.backends.local import LocalEngineBackend
from spectot.config import DraftOptions, ModelOptions, SearchOptions, TreeSearchOptions
from spectot.explore.explorer import Explorer, SharedBudget
from spectot.explore.oracle import OracleExplorer
from spectot.pipeline import Pipeline
from spectot.search.bfs import reward_balanced_search
from spectot.search.expansion import ChildKey, Expander, ExpansionSampling
from spectot.search.tree_search import PlainSource
from spectot.tasks.registry import load_problems, make_task
from spectot.tree_solve import tree_config


async def search_one(task, problem, backend, config, variant: str, k_total: int, lookahead: int, tree, seed: int):
    expander = Expander(task, problem, backend, "self_eval", seed, ExpansionSampling())
    if variant == "plain":
        source = PlainSource(expander)
    elif variant.startswith("spex"):
        source = Explorer(expander, SharedBudget(k_total), 0, lookahead, retract=variant == "spex-retract")
    else:
        source = OracleExplorer(expander, SharedBudget(k_total), tree, lookahead=lookahead)
    t = time.perf_counter()
    try:
        result = await reward_balanced_search(task, problem, source, config)
    finally:
        await source.close()
    seconds = time.perf_counter() - t
    counters = source.counters.to_dict() if isinstance(source, Explorer) else {}
    keys = [[list(c.key.parent), c.key.index, list(c.key.at)] for c in result.expansions]
    return {"seconds": seconds, "answer": result.answer, "keys": keys, "spec": counters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="gsm8k", choices=["gsm8k", "math500"])
    parser.add_argument("--data", default="../shared/data/gsm8k/test.jsonl")
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--search", default="rebase", choices=["rebase", "ets"])
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--k-total", type=int, default=8)
    parser.add_argument("--lookahead", default="1,2", help="comma-separated: one oracle variant each")
    parser.add_argument("--spex-lookahead", type=int, default=2, help="the product explorer's lookahead")
    parser.add_argument("--retract", action="store_true", help="also run the explorer with retract=True")
    parser.add_argument("--chunk", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "records.jsonl"
    done = {(r["id"], r["variant"]): r for r in map(json.loads, log.read_text().splitlines())} if log.exists() else {}

    model = ModelOptions(threads=args.threads)
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    search = SearchOptions(search=args.search)
    config = tree_config(search, TreeSearchOptions(budget=args.budget))
    task = make_task(args.task, search.depth, "")
    problems = load_problems(args.task, args.data, args.problems, 0, search.seed)
    warm = LocalEngineBackend.from_pipeline(pipe, "ar", name=model.target)

    async def warm_up() -> None:  # the first forwards build and load the kernels: not part of any variant's time
        try:
            await search_one(task, problems[0], warm, config, "plain", args.k_total, 0, [], 0)
        finally:
            await warm.aclose()

    asyncio.run(warm_up())
    oracles = [f"oracle-L{ahead}" for ahead in map(int, args.lookahead.split(","))]
    variants = ["plain", "spex", *(["spex-retract"] if args.retract else []), *oracles]
    for first in range(0, len(problems), args.chunk):
        chunk = problems[first : first + args.chunk]
        for variant in variants:
            todo = [p for p in chunk if (p.id, variant) not in done]
            if not todo:
                continue
            lookahead = int(variant.removeprefix("oracle-L")) if variant in oracles else args.spex_lookahead
            pipe.decoder.prefix_cache.clear()
            backend = LocalEngineBackend.from_pipeline(pipe, "ar", name=model.target)

            async def run(todo=todo, variant=variant, lookahead=lookahead, backend=backend, first=first) -> None:
                try:
                    for p in todo:
                        tree = (
                            [ChildKey(tuple(parent), i, tuple(at)) for parent, i, at in done[(p.id, "plain")]["keys"]]
                            if (variant in oracles)
                            else []
                        )
                        row = await search_one(task, p, backend, config, variant, args.k_total, lookahead, tree, 0)
                        row |= {"id": p.id, "variant": variant, "chunk": first}
                        done[(p.id, variant)] = row
                        with log.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        print(f"{variant:>10} {p.id}: {row['seconds']:.1f} s {row['spec'].get('hit_rate', '')}")
                finally:
                    await backend.aclose()

            asyncio.run(run())

    summary = {}
    for variant in variants:
        rows = [done[(p.id, variant)] for p in problems]
        seconds = sum(r["seconds"] for r in rows)
        plain = sum(done[(p.id, "plain")]["seconds"] for p in problems)
        same = sum(r["answer"] == done[(r["id"], "plain")]["answer"] for r in rows)
        per_chunk = []
        for first in range(0, len(problems), args.chunk):
            ids = [p.id for p in problems[first : first + args.chunk]]
            per_chunk.append(
                sum(done[(i, "plain")]["seconds"] for i in ids) / sum(done[(i, variant)]["seconds"] for i in ids)
            )
        speculated = sum(r["spec"].get("speculated", 0) for r in rows)
        hits = sum(r["spec"].get("hits", 0) for r in rows)
        summary[variant] = {
            "seconds": seconds,
            "speedup": plain / seconds,
            "per_chunk": per_chunk,
            "answers_equal_to_plain": f"{same}/{len(rows)}",
            "speculated": speculated,
            "hit_rate": hits / speculated if speculated else 0.0,
        }
    summary["settings"] = {k: str(v) for k, v in vars(args).items()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for variant in variants:
        s = summary[variant]
        chunks = " / ".join(f"{x:.2f}" for x in s["per_chunk"])
        print(
            f"{variant:>10}: {s['seconds']:.1f} s, {s['speedup']:.2f}x ({chunks}), answers {s['answers_equal_to_plain']}, "
            f"speculated {s['speculated']}, hit rate {s['hit_rate']:.2f}"
        )


if __name__ == "__main__":
    main()
