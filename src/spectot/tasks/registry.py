"""Task names -> task objects and problem lists, plus the small built-in example sets.

``spectot solve`` without ``--data`` runs on the examples below: a few problems written for spectot
(GSM8K-style word problems, Creative Writing sentence sets, MATH-style questions) and Blocksworld
instances generated with optimal plans. They are not taken from the datasets, which users pass as
paths.
"""

from __future__ import annotations

from typing import Literal

from spectot.data.jsonl import DataError
from spectot.tasks.base import Problem, Task

TaskName = Literal["gsm8k", "creative_writing", "blocksworld", "math500"]

GSM8K_EXAMPLES = [
    (
        "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them. How many muffins are "
        "left?",
        "12",
    ),
    (
        "Tom reads 15 pages a day for 6 days, then 20 pages on the seventh day. How many pages does he read in the "
        "week?",
        "110",
    ),
    (
        "A farmer has 5 rows of apple trees with 12 trees in each row. Each tree gives 8 baskets of apples. How many "
        "baskets does the farmer get?",
        "480",
    ),
    (
        "Lena buys 3 notebooks at $4 each and 2 pens at $1.50 each. She pays with a $20 bill. How much change does "
        "she get?",
        "5",
    ),
    (
        "A school bus carries 42 students. At the first stop 9 students get off and 5 get on. At the second stop 12 "
        "get off. How many students are on the bus now?",
        "26",
    ),
    ("Sam saves $7 every week. How many weeks does he need to save to buy a bike that costs $91?", "13"),
]
CREATIVE_WRITING_EXAMPLES = [
    "The lighthouse had been dark for twenty years. Nobody in the village could explain the music. She decided to "
    "keep the key for herself. By morning the boats had all come home.",
    "My grandfather never trusted elevators. The cake collapsed the moment we sang. Somewhere a phone kept ringing. "
    "We laughed about it for the rest of the summer.",
]
MATH_EXAMPLES = [
    ("What is the value of $3x + 7$ when $x = 5$?", "22"),
    ("Simplify $\\frac{18}{24}$.", "\\frac{3}{4}"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "720"),
    ("Solve for $x$: $2x - 9 = 11$.", "10"),
]


def make_task(name: TaskName, depth: int = 0, prompt_pool: str = "") -> Task:
    """The task object; ``depth`` 0 keeps the task's own depth; ``prompt_pool`` is Blocksworld's alone."""
    if prompt_pool and name != "blocksworld":
        raise ValueError(f"--prompt-pool is Blocksworld's RAP prompt pool; --task {name} would not read it")
    if name == "gsm8k":
        from spectot.tasks.gsm8k import Gsm8kTask

        return Gsm8kTask(depth=depth or 4)
    if name == "math500":
        from spectot.tasks.math500 import Math500Task

        return Math500Task(depth=depth or 4)
    if name == "blocksworld":
        from spectot.tasks.blocksworld import BlocksworldTask

        return BlocksworldTask(prompt_pool or None, depth=depth or 7)
    if name == "creative_writing":
        from spectot.tasks.creative_writing import CreativeWritingTask

        task = CreativeWritingTask()
        if depth and depth != 2:
            raise ValueError("creative_writing has depth 2 (a plan, then the passage)")
        return task
    raise ValueError(f"unknown task '{name}': choose gsm8k, creative_writing, blocksworld or math500")


def load_problems(
    name: TaskName, path: str = "", limit: int = 0, offset: int = 0, seed: int = 0, complete: bool = False
) -> list[Problem]:
    """Problems ``offset .. offset + limit`` (limit 0 = all) of a data file, or of the built-in examples;
    ``complete``: fewer than ``limit`` is a DataError (a benchmark asked for that many), not a shorter run."""
    if not path:
        problems = builtin_problems(name, offset + (limit or 6), seed)
    elif name == "gsm8k":
        from spectot.tasks.gsm8k import load_problems as load

        problems = load(path, offset + limit if limit else 0)
    elif name == "math500":
        from spectot.tasks.math500 import load_problems as load

        problems = load(path, offset + limit if limit else 0)
    elif name == "blocksworld":
        from spectot.tasks.blocksworld import load_problems as load

        problems = load(path, offset + limit if limit else 0)
    else:
        from spectot.tasks.creative_writing import load_problems as load

        problems = load(path, 0, 0)  # its offset counts lines, this one problems
    picked = problems[offset : offset + limit if limit else None]
    if not picked:  # an empty file or an offset past its end: nothing would run, and nothing would say so
        raise DataError(f"{path or f'the built-in {name} examples'}: no problems from offset {offset}")
    if complete and len(picked) < limit:
        raise DataError(
            f"{path or f'the built-in {name} examples'}: {len(picked)} problem(s), the run asks for {limit}"
        )
    return picked


def builtin_problems(name: TaskName, count: int, seed: int = 0) -> list[Problem]:
    if name == "blocksworld":
        from spectot.tasks.blocksworld import builtin_prompt_pool, demo_problems, generate_instances

        # the built-in prompt pool's demos come from the same generator (seed 2024): never one of the problems
        demos = builtin_prompt_pool().demos
        problems = generate_instances(num_blocks=4, count=count + len(demos), seed=seed, min_steps=2, max_steps=6)
        leaked = {p.id for p in demo_problems(problems, demos)}
        return [p for p in problems if p.id not in leaked][:count]
    if name == "creative_writing":
        from spectot.tasks.creative_writing import required_sentences

        items = [(f"example-{i + 1}", s, required_sentences(s)) for i, s in enumerate(CREATIVE_WRITING_EXAMPLES)]
    else:
        pairs = GSM8K_EXAMPLES if name == "gsm8k" else MATH_EXAMPLES
        items = [(f"example-{i + 1}", q, a) for i, (q, a) in enumerate(pairs)]
    return [Problem(i, q, a) for i, q, a in items[:count]]
