"""The target's own Tree-of-Thoughts steps on GSM8K train questions: draft-training text in the form the
Thought Generator produces it.

One sampled path per question at temperature 1 (the temperature ToT samples thoughts at): step k's prompt is
the task's thought prompt after the k - 1 steps sampled before it, the very text `spectot solve --task gsm8k`
sends G, with the same stop strings and token budget. A path that reaches the final answer early stops there.

Output: one engine-output JSONL file per step (``OUT.step1.jsonl``, ...: prompt_ids + token_ids, what
`spectot train-draft --corpus` reads), appended batch by batch; a rerun resumes inside the step it stopped in.

    python scripts/tot_corpus.py --data ../shared/data/gsm8k/train.jsonl --offset 3328 --limit 300 --out DIR/tot_gsm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spectot.pipeline import Pipeline
from spectot.tasks.registry import load_problems, make_task


def sample_step(
    pipe: Pipeline, task, step: int, todo: list, states: dict, path: Path, seed: int, batch_size: int
) -> None:
    """Append to ``path`` step ``step`` of every problem in ``todo`` that it does not hold yet."""
    done = [json.loads(line) for line in path.open()] if path.exists() else []
    if any(d["prompt"] != task.thought(p, states[p.id]).prompt for d, p in zip(done, todo)):
        sys.exit(f"{path} holds another run's prompts: remove it or pick another --out")
    rest = todo[len(done) :]
    if not rest:
        return
    written = len(done)
    with path.open("a") as out:

        def write(batch) -> None:
            nonlocal written
            for g in batch:
                out.write(json.dumps(g.to_dict()) + "\n")
            out.flush()
            written += len(batch)
            print(f"step {step}: {written}/{len(todo)} thoughts", file=sys.stderr)

        request = task.thought(rest[0], states[rest[0].id])
        pipe.generate(
            [task.thought(p, states[p.id]).prompt for p in rest],
            max_new_tokens=request.max_new_tokens,
            do_sample=True,
            temperature=1.0,
            method="ar",
            stop=request.stop,
            seed=seed,
            batch_size=batch_size,
            on_batch=write,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="GSM8K JSONL (train split: the test split stays held out)")
    parser.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    parser.add_argument("--limit", type=int, default=300, help="questions to take")
    parser.add_argument("--out", required=True, help="output prefix: writes PREFIX.step1.jsonl ... PREFIX.stepT.jsonl")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    pipe = Pipeline.load(draft="none")
    task = make_task("gsm8k")
    problems = load_problems("gsm8k", args.data, limit=args.limit, offset=args.offset)
    states = {p.id: () for p in problems}
    for step in range(1, task.depth + 1):
        todo = [p for p in problems if len(states[p.id]) == step - 1 and not task.is_final(p, states[p.id])]
        path = Path(f"{args.out}.step{step}.jsonl")
        sample_step(pipe, task, step, todo, states, path, args.seed + step, args.batch_size)
        for line, p in zip(path.open(), todo):
            states[p.id] = (*states[p.id], task.parse_thought(p, states[p.id], json.loads(line)["text"]))


if __name__ == "__main__":
    main()
