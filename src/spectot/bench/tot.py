"""`spectot bench tot`: SEED's tables 1 and 2 on this machine — every engine, same problems, one run.

For each task (GSM8K depth 4, Creative Writing depth 2, Blocksworld depth 7) and each engine, ToT-BFS
runs the same problems with the same seeds on one loaded target; per engine: wall time, tokens,
tokens per target step and acceptance rate of the Thought Generator (TG) and State Evaluator (SE),
accuracy, whether the answers (and the chosen paths of thoughts) equal serial ``ar``'s, and the speedup over serial ``ar`` and over
``batched-ar``. A problem is one record (appended as it finishes), so an interrupted run resumes. With
``--in-flight N`` the continuous engines search N problems at once; such a unit's wall time is shared
equally by its problems' records (their sum is the run's wall time). The engines take turns on chunks of
``--chunk`` problems (each engine made afresh for its turn), so the machine's drift hits every engine alike; one
untimed short generation runs first, so the first engine (usually ``ar``, the baseline) does not pay the process's
first forwards.
Greedy decoding makes every engine's tree identical to ``ar``'s; at temperature 1 (the default, as in
the paper) ``ar`` and ``batched-ar`` still draw identical samples, speculative engines draw from the
same distribution with other random numbers.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import asdict, replace
from pathlib import Path

import torch

from spectot.bench.progress import progress_bar
from spectot.bench.records import append_record, load_records, machine_info, refuse_failures, run_identity
from spectot.config import (
    BenchTotOptions,
    DraftOptions,
    ModelOptions,
    SearchOptions,
    SolveOptions,
    check_generation,
)
from spectot.search.policy import ComponentStats
from spectot.spec.decoding import Decoder


def run_bench_tot(
    model_opts: ModelOptions, draft_opts: DraftOptions, search: SearchOptions, opts: BenchTotOptions
) -> dict:
    from spectot.pipeline import Pipeline, make_engine, measure_solve_costs, make_proposer
    from spectot.solve import run_solve
    from spectot.tasks.registry import load_problems

    tasks = [t.strip() for t in opts.tasks.split(",") if t.strip()]
    run_id = uuid.uuid4().hex[:12]  # this invocation: problems an engine and ar measured apart are flagged
    engines = opts.engine_names(draft_opts.draft)  # checked before the model loads, not halfway through the run
    data = {task: getattr(opts, task) if task != "math500" else "" for task in tasks}  # "": the built-in examples
    for task in tasks:  # so is the data: a file short of --problems would end the run at its summary
        load_problems(task, data[task], opts.problems, complete=True)
        check_generation(task, search.generation)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if model_opts.threads:
        torch.set_num_threads(model_opts.threads)
    pipe = Pipeline.from_options(model_opts, DraftOptions(draft="none"))
    # a record depends on the problem, model, draft and search settings, not on which cells a run asks for:
    # tasks, engines and problems can be added to a finished run
    selection = ("tasks", "engines", "problems", "out")
    config_key = {k: v for k, v in asdict(opts).items() if k not in selection}
    config_key = run_identity(config_key | {**asdict(model_opts), **asdict(draft_opts), **asdict(search)})
    records = load_records(out / "records.jsonl", config_key)
    costs = records.get(("costs",))
    if costs is None and draft_opts.draft != "none":  # one t(n) / c measurement shared by every engine
        costs = measure_solve_costs(pipe, make_proposer(replace(draft_opts, tree="chain"), pipe.target, model_opts))
        append_record(out / "records.jsonl", config_key, ("costs",), costs, records)
    (out / "profile.json").write_text(json.dumps(costs or {}))
    # the engines take turns on each chunk of problems (drift lands on all alike, not on the engine then running)
    turns = range(0, opts.problems, opts.turn)
    cells = [
        (t, e, i)
        for t in tasks
        for first in turns
        for e in engines
        for i in range(first, min(first + opts.turn, opts.problems))
    ]

    def width_of(engine: str) -> int:  # a continuous engine searches `in_flight` problems at once
        return opts.in_flight if engine.startswith("continuous") else 1

    def unit_of(engine: str, i: int) -> list[int]:
        """[first problem, problems] of i's timed unit: `in_flight` problems of a turn for a continuous engine
        (turns are whole units; the last of a run may be short), else i alone."""
        width = width_of(engine)
        first = i - (i % opts.turn) % width
        return [first, min(first + width, first - first % opts.turn + opts.turn, opts.problems) - first]

    def measured(task: str, engine: str, i: int) -> bool:
        """Whether i has a record of the unit it belongs to now. A unit's counters ride on its first record, so
        a unit cut short by a kill runs again whole (running only its missing problems counted their tokens
        twice), and so does one another --problems regroups (its first record held the counters of problems
        outside the run, or a new unit's counters were dropped for an old record)."""
        record = records.get((task, engine, i))
        return record is not None and record.get("unit") == unit_of(engine, i)

    missing = {(t, e, unit_of(e, i)[0]) for t, e, i in cells if not measured(t, e, i)}
    todo = [(t, e, i) for t, e, i in cells if (t, e, unit_of(e, i)[0]) in missing]
    made = {}  # one engine per (task, engine) across a turn's problems, as `spectot solve --limit N` runs them
    if todo:  # untimed: the process's first forwards (kernel loads, thread pools) must not land on the first engine,
        # nor its first sampled token (the noise kernel loads then): thoughts are sampled
        warm_up = ["Warm-up: two plus two is", "A second row"]
        pipe.generate(warm_up, max_new_tokens=8, method="ar", batch_size=2, do_sample=True)
    with progress_bar() as bar, contextlib.ExitStack() as engines_open:
        engines_open.callback(lambda: _close(made))  # a continuous engine's worker thread holds an OpenMP pool
        job = bar.add_task("bench tot", total=len(todo))
        while todo:
            task, engine, i = todo[0]
            width = width_of(engine)  # problems searched at once: one timed unit, its wall time shared
            span = unit_of(engine, i)  # todo holds whole units, each in order: i is its unit's first
            unit, todo = todo[: span[1]], todo[span[1] :]
            solve = SolveOptions(
                task=task,
                data=data[task],
                limit=len(unit),
                offset=i,
                engine=engine,
                prompt_pool=opts.prompt_pool if task == "blocksworld" else "",
                profile=str(out / "profile.json") if costs else "",
            )
            if (task, engine) not in made:
                # the previous engine closed first: a continuous one left running kept its worker's OpenMP pool,
                # and with more threads than cores every later engine ran slower (they stop spinning)
                _close(made)
                made = {(task, engine): make_engine(pipe, engine, draft_opts, model_opts, costs)}
            # each timed unit starts cold: the same prefill work for all, the draft's own prefixes too (a trained
            # draft kept its KV of the shared prompt header across an engine's units); every engine's decoder
            # shares the pipeline's target prefix cache
            (_decoder_of(made[(task, engine)][0]) or pipe.decoder).clear_prefix_caches()
            run = run_solve(
                model_opts, draft_opts, search, solve, pipe=pipe, engine=made[(task, engine)], in_flight=width
            )
            refuse_failures(run.records, f"bench tot {task} {engine}")
            for (_, _, n), record in zip(unit, run.records):
                value = {
                    "answer": record["answer"],
                    "best_state": record["best_state"],
                    "grade": record["grade"],
                    "seconds": run.seconds / len(unit),
                    "in_flight": width,
                    "unit": span,
                    "run": run_id,
                    # the unit's counters, once: summarise adds them up over the records
                    "components": {name: asdict(c) for name, c in run.stats.items()} if n == i else {},
                }
                records.pop((task, engine, n), None)  # a record of another unit: this line replaces it
                append_record(out / "records.jsonl", config_key, (task, engine, n), value, records)
            bar.advance(job, len(unit))
    rows = [
        summarise(
            task,
            engine,
            [records[(task, engine, i)] for i in range(opts.problems)],
            [records[(task, "ar", i)] for i in range(opts.problems)] if "ar" in engines else None,
        )
        for task in tasks
        for engine in engines
    ]
    for task in tasks:
        base = {r["engine"]: r["seconds"] for r in rows if r["task"] == task}
        # the batched baseline is the faster of spectot's batched-ar and transformers' padded generate()
        batched = min((base[e] for e in ("batched-ar", "hf-batched-ar") if e in base), default=None)
        for r in rows:
            if r["task"] == task:
                r["speedup_vs_ar"] = base["ar"] / r["seconds"] if "ar" in base else None
                r["speedup_vs_batched-ar"] = batched / r["seconds"] if batched else None
    result = {
        "rows": rows,
        "costs": costs,
        "config": config_key,
        "machine": machine_info(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(rows))
    return result


def summarise(task: str, engine: str, values: list[dict], ar: list[dict] | None) -> dict:
    comps: dict[str, ComponentStats] = {}
    for v in values:
        for name, c in v["components"].items():
            total = comps.setdefault(name, ComponentStats())
            for k, x in c.items():
                setattr(total, k, getattr(total, k) + x)
    row = {
        "task": task,
        "engine": engine,
        "problems": len(values),
        "seconds": sum(v["seconds"] for v in values),
        "in_flight": max(v.get("in_flight", 1) for v in values),
        "accuracy": sum(v["grade"] for v in values) / len(values),
        "new_tokens": sum(c.new_tokens for c in comps.values()),
        "same_answers_as_ar": None if ar is None else sum(v["answer"] == a["answer"] for v, a in zip(values, ar)),
        # the chosen path of thoughts: under greedy decoding every engine's equals ar's (the lossless check)
        "same_paths_as_ar": None if ar is None else sum(v["best_state"] == a["best_state"] for v, a in zip(values, ar)),
        # problems measured in another run than ar's same problem (an engine added to a finished run, a resume
        # between them): the speedup compares two moments of the machine
        "problems_apart": 0 if ar is None else sum(v.get("run") != a.get("run") for v, a in zip(values, ar)),
    }
    for name, c in comps.items():
        row[f"{name}_tokens_per_step"] = c.tokens_per_step
        row[f"{name}_acceptance"] = c.acceptance_rate
        row[f"{name}_seconds"] = c.seconds
    row["tokens_per_second"] = row["new_tokens"] / row["seconds"] if row["seconds"] else 0.0
    return row


def markdown(rows: list[dict]) -> str:
    head = (
        "| task | engine | in flight | problems | seconds | tok/s | speedup vs ar | speedup vs best batched-ar | "
        "TG tok/step | SE tok/step | TG accept | SE accept | TG s | SE s | accuracy | same answer as ar | "
        "same path as ar |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    fmt = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [
        f"| {r['task']} | {r['engine']} | {r['in_flight']} | {r['problems']} | {fmt(r['seconds'], 1)} | "
        f"{fmt(r['tokens_per_second'], 1)} | "
        f"{fmt(r.get('speedup_vs_ar'))}{_apart(r)} | {fmt(r.get('speedup_vs_batched-ar'))} | "
        f"{fmt(r.get('TG_tokens_per_step'))} | "
        f"{fmt(r.get('SE_tokens_per_step'))} | {fmt(r.get('TG_acceptance'))} | {fmt(r.get('SE_acceptance'))} | "
        f"{fmt(r.get('TG_seconds'), 1)} | {fmt(r.get('SE_seconds'), 1)} | {fmt(r['accuracy'])} | "
        f"{'-' if r['same_answers_as_ar'] is None else r['same_answers_as_ar']}/{r['problems']} | "
        f"{'-' if r['same_paths_as_ar'] is None else r['same_paths_as_ar']}/{r['problems']} |"
        for r in rows
    ]
    note = (
        "\n† n of its problems were measured in another run of the benchmark than ar's (an engine added to a finished "
        "run, or a run resumed between them): that speedup compares two moments of the machine.\n"
        if any(r.get("problems_apart") and r["engine"] != "ar" for r in rows)
        else ""
    )
    return head + "\n".join(lines) + "\n" + note


def _apart(row: dict) -> str:
    """'†n' after a speedup when n of its problems were measured in another run than ar's same problem."""
    return f" †{row['problems_apart']}" if row.get("problems_apart") and row["engine"] != "ar" else ""


def _decoder_of(engine: object) -> Decoder | None:
    """The engine's own decoder (a continuous engine's is its worker's); None for transformers' generate()."""
    inner = getattr(engine, "engine", None)  # ContinuousLevelEngine
    return getattr(engine, "decoder", None) or getattr(inner, "decoder", None)


def _close(engines: dict) -> None:
    """Close the engines that hold a worker (continuous ones); the others need nothing. ``engines`` maps a
    (task, engine name) to ``make_engine``'s (engine, method)."""
    for engine, _ in engines.values():
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    engines.clear()
