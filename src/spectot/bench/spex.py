"""`spectot bench spex`: SPEX's table and plot on this machine — REBASE and rStar, with and without speculation.

For each task (GSM8K, MATH-500), search (REBASE, rStar), queries in flight (1 / 4 / 8) and variant —
``plain`` (the async search alone), ``spex`` (+ speculative exploration), ``sd`` (+ token-level
speculative decoding inside every expansion), ``spex+sd`` (both), and on request ``spex+es`` /
``spex+sd+es`` (+ SPEX's early termination: a query stops once its weighted vote is settled, which may
change its answer) — the same questions run with the same seeds on one loaded target: questions per
minute, accuracy, speculation hit / saving rates, wasted tokens, budget use, and the speedup over
``plain`` at the same concurrency. Before the table, the local engine's throughput is measured at rising
concurrency; k_total (SPEX's global cap on expansions in flight) is the most requests that still run at
nearly solo speed (``--fixed-k-total`` sets it instead). Finally one cell runs again through
``spectot serve`` + the OpenAI backend over loopback, to show the remote path gives the same answers.
A cell runs in chunks of ``--chunk`` questions, the variants of its (task, search, queries in flight)
taking turns on each chunk, so the machine's speed drifting over a group's minutes hits every variant
alike; every chunk is one record (appended as it finishes), so an interrupted run resumes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path

import torch

from spectot.bench.progress import progress_bar
from spectot.bench.records import (
    append_record,
    content_id,
    load_records,
    machine_info,
    refuse_failures,
    run_identity,
)
from spectot.explore.bound import per_request_rate, replay_seconds
from spectot.explore.budget import k_total_from_curve
from spectot.tree_solve import TreeSolveRun
from spectot.config import (
    BenchSpexOptions,
    DraftOptions,
    ModelOptions,
    SearchOptions,
    SPEX_VARIANTS,
    SolveOptions,
    ThoughtSampling,
    TreeSearchOptions,
)

logger = logging.getLogger(__name__)


def run_bench_spex(
    model: ModelOptions,
    draft: DraftOptions,
    tree: TreeSearchOptions,
    opts: BenchSpexOptions,
    sampling: ThoughtSampling | None = None,
) -> dict:
    from spectot.backends.local import LocalEngineBackend
    from spectot.pipeline import Pipeline, adaptive_draft_length, measure_solve_costs
    from spectot.spec.proposers.base import drafts_chains
    from spectot.tasks.registry import load_problems
    from spectot.tree_solve import draft_priority, run_tree_solve

    sampling = sampling or ThoughtSampling()  # T = 1, no nucleus, greedy evaluations
    run_id = uuid.uuid4().hex[:12]  # this invocation: chunks of two variants measured apart are flagged
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if model.threads:
        torch.set_num_threads(model.threads)
    searches = _split(opts.searches)
    in_flight = [int(x) for x in _split(opts.in_flight)]
    variants = _split(opts.variants)  # known names, one at least: BenchSpexOptions checked them
    needs_draft = any(SPEX_VARIANTS[v][1] == "sd" for v in variants)
    if needs_draft and draft.draft == "none":
        raise ValueError("the sd variants need a draft: pass --draft ngram (or a trained draft)")
    if tree.early_stop:
        raise ValueError("bench spex asks for early termination per variant: drop --early-stop, add spex+es")
    tasks = [(name, path) for name, path in (("gsm8k", opts.gsm8k), ("math500", opts.math500)) if path]
    for name, path in tasks:  # before the model loads: a file short of --problems ended the run late
        load_problems(name, path, opts.problems, complete=True)
    # the adaptive draft length is built per chunk below, from costs recorded once: Pipeline's own would be timed
    # afresh by every process (a resumed run's sd chunks ran under other k estimates) and learn across chunks
    pipe = Pipeline.from_options(model, replace(draft, adaptive_k=False) if needs_draft else DraftOptions(draft="none"))
    adaptive = needs_draft and draft.adaptive_k and drafts_chains(pipe.proposer)
    # a cell's record depends on the questions, model, draft and search settings, not on which cells are asked for
    # (each cell records its task's data file instead: a cell is redone when that file changes)
    selection = ("gsm8k", "math500", "searches", "in_flight", "variants", "remote", "out")
    config_key = {k: v for k, v in asdict(opts).items() if k not in selection}
    config_key = run_identity(config_key | {**asdict(model), **asdict(draft), **asdict(tree), **asdict(sampling)})
    records = load_records(out / "records.jsonl", config_key)
    costs = records.get(("costs",))
    if adaptive and costs is None:
        costs = measure_solve_costs(pipe, pipe.proposer)
        append_record(out / "records.jsonl", config_key, ("costs",), costs, records)

    k_total = opts.fixed_k_total
    if not k_total:  # read off the engine's throughput curve (minutes on a slow machine: skipped when fixed)
        curve = records.get(("concurrency",))
        if curve is None:
            curve = measure_concurrency(pipe)
            append_record(out / "records.jsonl", config_key, ("concurrency",), curve, records)
        k_total = _k_total(curve)

    cells = [(t, s, q, v) for t, _ in tasks for s in searches for q in in_flight for v in variants]
    # a cell runs chunk by chunk, the variants of its group taking turns on each chunk of questions, so the
    # machine's drift over the minutes a group takes hits every variant alike
    # ... and in a rotating order (chunk j starts with variant j), so no variant always runs first (plain did:
    # a disturbance at a chunk's start fell on it alone)
    todo = [
        (task, search, queries, variant, first)
        for task, _ in tasks
        for search in searches
        for queries in in_flight
        for j, first in enumerate(chunk_starts(opts.problems, opts.chunk, queries))
        for variant in variants[j % len(variants) :] + variants[: j % len(variants)]
    ]
    data = {name: {"path": path, "content": content_id(path)} for name, path in tasks}
    for key in [k for k in records if len(k) == 5 and k[0] in data and records[k]["data"] != data[k[0]]]:
        del records[key]  # run on another data file (or this one before an edit): neither reused nor reported
    todo = [c for c in todo if c not in records]
    if todo:  # untimed: the process's first forwards and first sampled token (the noise kernel loads then) must not
        # land on the first chunk's first variant (the concurrency sweep warmed them, when it ran in this process)
        warm_up = ["Warm-up: two plus two is", "A second row"]
        pipe.generate(warm_up, max_new_tokens=8, method="ar", batch_size=2, do_sample=True)
    with progress_bar() as bar:
        job = bar.add_task("bench spex", total=sum(_chunk_size(opts, c[2], c[4]) for c in todo))
        for task, search, queries, variant, first in todo:
            explore, method, early_stop = SPEX_VARIANTS[variant]
            # each chunk starts cold, the draft too (spex+sd found sd's KV of the same questions): the same
            # prefill work for every variant
            pipe.decoder.clear_prefix_caches()
            if adaptive:  # and no k learnt by the chunk before: each sd chunk starts from the same estimates
                pipe.decoder.draft_length = adaptive_draft_length(draft, model, costs, pipe.proposer)
            backend = LocalEngineBackend.from_pipeline(
                pipe,
                method,
                name=model.target,
                fill_rows=tree.fill_rows,
                draft_priority=draft_priority(tree),
                num_draft_tokens=draft.num_draft_tokens,
            )
            options = replace(
                tree,
                explore=explore,
                k_total=k_total,
                queries_in_flight=queries,
                early_stop=early_stop,
                budget_wakeup=tree.budget_wakeup or variant == "spex+wake",
            )
            size = _chunk_size(opts, queries, first)
            solve = SolveOptions(task=task, data=dict(tasks)[task], limit=size, offset=first)
            bar.update(job, description=f"{task} {search} x{queries} {variant} q{first + 1}-{first + size}")
            run = run_tree_solve(
                SearchOptions(search=search, **asdict(sampling)),
                options,
                solve,
                backend,
                report=lambda *a: bar.advance(job),
            )
            refuse_failures(run.records, f"bench spex {task} {search} {variant}")
            value = {"seconds": run.seconds, "engine": run.engine, "queries": [_lean(r) for r in run.records]}
            value |= {"k_total": k_total, "early_stop": options.early_stop, "data": data[task], "run": run_id}
            append_record(out / "records.jsonl", config_key, (task, search, queries, variant, first), value, records)
            write_results(out, records, cells, config_key, opts)  # the table so far: an interrupted run has one
    remote = records.get(("remote",))
    if opts.remote and remote is None and tasks:
        first = SearchOptions(search=searches[0], **asdict(sampling))
        remote = check_remote(pipe, model, tree, tasks[0], first, min(opts.problems, 4), k_total)
        append_record(out / "records.jsonl", config_key, ("remote",), remote, records)

    return write_results(out, records, cells, config_key, opts)


BFS = ("rebase", "ets")  # searches with reward barriers per level: a plain row has a ceiling


def chunk_starts(problems: int, chunk: int, queries: int) -> range:
    """First question of each chunk: ``chunk`` questions (at least two rounds of ``queries`` in flight, so a
    chunk's tail, where fewer run, stays short), or the whole cell for ``chunk`` = 0."""
    size = max(chunk, 2 * queries) if chunk else problems
    return range(0, problems, size)


def _chunk_size(opts: BenchSpexOptions, queries: int, first: int) -> int:
    """Questions in the chunk that starts at ``first`` (the last may be short)."""
    return min(chunk_starts(opts.problems, opts.chunk, queries).step, opts.problems - first)


def _lean(record: dict) -> dict:
    """What a cell's summary needs of a query's record (its search tree stays out of the records file)."""
    kept = ("id", "answer", "score", "seconds", "tokens", "expansions", "stopped_early", "spec")
    result = {k: record["result"][k] for k in ("level_seconds", "critical_path_seconds") if k in record["result"]}
    if record["search"] in BFS and "tree" in record["result"]:  # (parent, tokens) per node, for the replay
        result["tree"] = [[parent, tokens] for parent, tokens, _ in record["result"]["tree"]]
    return {**{k: record[k] for k in kept}, "result": result}


def cell_value(chunks: list[dict]) -> dict:
    """A cell's summary from its chunks' records: their queries, seconds and engine counters added up."""
    engine: dict = {}
    for c in chunks:
        for k, v in c["engine"].items():
            engine[k] = max(engine.get(k, 0), v) if k == "max_live" else engine.get(k, 0) + v
    run = TreeSolveRun([q for c in chunks for q in c["queries"]], sum(c["seconds"] for c in chunks), engine)
    answers = {q["id"]: q["answer"] for c in chunks for q in c["queries"]}
    return {**run.summary(), "k_total": chunks[0]["k_total"], "early_stop": chunks[0]["early_stop"], "answers": answers}


def machine_ceiling(chunks: list[dict], curve: dict, queries: int, k_total: int, lookahead: int) -> float | None:
    """The plain BFS chunks' trees replayed on the measured throughput curve (explore/bound.py): their time
    at the reward barriers over their time with perfect speculation at this k_total and lookahead. None for
    records written before the trees were kept."""
    if any("tree" not in q["result"] for c in chunks for q in c["queries"]):
        return None
    rate = per_request_rate(curve["concurrency"], curve["tokens_per_second"])
    trees = [[q["result"]["tree"] for q in sorted(c["queries"], key=_question_order)] for c in chunks]
    barrier = sum(replay_seconds(t, rate, queries) for t in trees)
    speculating = sum(replay_seconds(t, rate, queries, k_total, lookahead) for t in trees)
    return barrier / speculating if speculating else None


def _question_order(query: dict) -> tuple:
    """Records come in finishing order; the replay admits questions in the order the run did."""
    return (0, int(query["id"]), "") if str(query["id"]).isdigit() else (1, 0, str(query["id"]))


def write_results(out: Path, records: dict, cells: list[tuple], config_key: dict, opts: BenchSpexOptions) -> dict:
    """results.json / results.md from the records of the finished chunks: the cells asked for and those of
    earlier runs of the same configuration, by task, search, in flight, variant. A cell still running shows
    the chunks it has; its speedup compares it with plain on the chunks both have."""
    order = list(SPEX_VARIANTS)
    curve, remote = records.get(("concurrency",)), records.get(("remote",))
    chunked = {key[:4] for key in records if len(key) == 5}
    cells = sorted({*cells, *chunked}, key=lambda c: (*c[:3], order.index(c[3])))
    rows = []
    for cell in cells:
        task, search, queries, variant = cell
        starts = chunk_starts(opts.problems, opts.chunk, queries)
        done = [first for first in starts if (*cell, first) in records]
        if not done:
            continue
        value = cell_value([records[(*cell, first)] for first in done])
        data = records[(*cell, done[0])].get("data")
        row = {"task": task, "data": data["path"] if isinstance(data, dict) else data}
        row |= {"search": search, "in_flight": queries, "variant": variant}
        row.update({k: v for k, v in value.items() if k not in ("answers", "engine")})
        both = [first for first in done if (task, search, queries, "plain", first) in records]
        if variant == "plain" and search in BFS and curve is not None:
            chunks = [records[(*cell, first)] for first in done]
            row["machine_ceiling"] = machine_ceiling(chunks, curve, queries, value["k_total"], config_key["lookahead"])
        row["speedup_vs_plain"] = row["accuracy_delta_vs_plain"] = row["same_answers_as_plain"] = None
        # chunks this variant and plain measured in different invocations (a variant added to a finished run, a
        # run resumed between them): their speedup compares two moments of the machine, not one run
        row["chunks_apart"] = sum(
            records[(task, search, queries, "plain", first)].get("run") != records[(*cell, first)].get("run")
            for first in both
        )
        # each chunk's own speedup: the chunks take turns, so the machine's drift shows as their spread
        row["chunk_speedups"] = [
            records[(task, search, queries, "plain", first)]["seconds"] / records[(*cell, first)]["seconds"]
            for first in both
        ]
        if both:
            plain = cell_value([records[(task, search, queries, "plain", first)] for first in both])
            mine = value if both == done else cell_value([records[(*cell, first)] for first in both])
            row["speedup_vs_plain"] = plain["seconds"] / mine["seconds"]
            row["accuracy_delta_vs_plain"] = mine["accuracy"] - plain["accuracy"]
            same = [mine["answers"][q] == a for q, a in plain["answers"].items()]
            row["same_answers_as_plain"] = [sum(same), len(same)]
        rows.append(row)
    if curve is not None:  # derived here, so a stored curve always shows the current rule's k_total
        curve = {**curve, "k_total": config_key.get("fixed_k_total") or _k_total(curve)}
    result = {
        "rows": rows,
        "concurrency": curve,
        "remote": remote,
        "config": config_key,
        "machine": machine_info(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(rows, curve, remote, config_key))
    plot(rows, out / "results.png")
    return result


def plot(rows: list[dict], path: Path) -> None:
    """Speedup over plain at each number of queries in flight, one panel per task and search, one bar per
    variant (plain's own bar is the line at 1)."""
    panels = sorted({(r["task"], r["search"]) for r in rows})
    variants = [v for v in SPEX_VARIANTS if v != "plain" and any(r["variant"] == v for r in rows)]
    if not panels or not variants:
        return
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend switch
    except ImportError:
        logger.warning("matplotlib not installed: skipping %s (pip install 'spectot[bench]')", path)
        return
    fig = Figure(figsize=(4.2 * len(panels), 3.6))
    width = 0.8 / len(variants)
    for p, (task, search) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), p + 1, sharey=fig.axes[0] if fig.axes else None)
        mine = [r for r in rows if (r["task"], r["search"]) == (task, search)]
        levels = sorted({r["in_flight"] for r in mine})
        for v, variant in enumerate(variants):
            speedup = {r["in_flight"]: r["speedup_vs_plain"] for r in mine if r["variant"] == variant}
            xs = [i + (v - (len(variants) - 1) / 2) * width for i, q in enumerate(levels) if speedup.get(q)]
            ax.bar(xs, [speedup[q] for q in levels if speedup.get(q)], width, label=variant)
        ax.axhline(1.0, color="#555", linewidth=1)
        ax.set_xticks(range(len(levels)), [str(q) for q in levels])
        ax.set_xlabel("queries in flight")
        ax.set_title(f"{task} · {search}")
        if p == 0:
            ax.set_ylabel("questions / min over plain")
    fig.axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure_concurrency(pipe, levels=(1, 2, 4, 8, 16, 32), tokens: int = 32, rounds: int = 3) -> dict:
    """Generated tokens per second of the local engine with n requests in flight (``_k_total`` reads
    SPEX's k_total off it): the median of ``rounds`` sweeps over the levels, so a drift in the machine's
    speed during one sweep (seen here: 98 against 136 tokens/s solo in two runs) cannot move k_total."""
    from spectot.backends.base import CompletionRequest
    from spectot.backends.local import LocalEngineBackend

    prompt = "Write a short story about a robot who learns to paint."

    async def rate(n: int) -> float:
        backend = LocalEngineBackend.from_pipeline(pipe)
        try:
            requests = [CompletionRequest(prompt, tokens, 1.0, seed=i, chat=True) for i in range(n)]
            await backend.complete(requests[0])  # warm-up
            t = time.perf_counter()
            done = await asyncio.gather(*(backend.complete(r) for r in requests))
            return sum(c.completion_tokens for c in done) / (time.perf_counter() - t)
        finally:
            await backend.aclose()

    sweeps = [[asyncio.run(rate(n)) for n in levels] for _ in range(rounds)]
    throughput = [statistics.median(sweep[i] for sweep in sweeps) for i in range(len(levels))]
    return {
        "concurrency": list(levels),
        "tokens_per_second": throughput,
        "sweeps": sweeps,
    }


def _k_total(curve: dict) -> int:
    """The most requests in flight that still run at nearly solo speed on the measured curve."""
    return k_total_from_curve(curve["concurrency"], curve["tokens_per_second"])


def check_remote(
    pipe, model: ModelOptions, tree: TreeSearchOptions, task, search: SearchOptions, n: int, k_total: int
) -> dict:
    """The same questions through `spectot serve` + the OpenAI backend and in-process: same answers?"""
    from spectot.backends.local import LocalEngineBackend
    from spectot.backends.openai import OpenAIBackend
    from spectot.server.app import BackgroundServer, create_app
    from spectot.tree_solve import run_tree_solve

    name, data = task
    options = replace(tree, explore="spex", k_total=k_total, queries_in_flight=4)
    solve = SolveOptions(task=name, data=data, limit=n)
    local = run_tree_solve(search, options, solve, LocalEngineBackend.from_pipeline(pipe))
    refuse_failures(local.records, "bench spex's remote check")
    served = LocalEngineBackend.from_pipeline(pipe, name=model.target)
    with BackgroundServer(create_app(served)) as server:
        remote_backend = OpenAIBackend.from_urls([f"{server.url}/v1"], model.target)
        remote = run_tree_solve(search, options, solve, remote_backend)
        refuse_failures(remote.records, "bench spex's remote check (through the server)")
    asyncio.run(served.aclose())
    same = lambda run: {r["id"]: r["answer"] for r in run.records}  # noqa: E731
    return {
        "task": name,
        "search": search.search,
        "questions": n,
        "local": local.summary(),
        "remote": remote.summary(),
        "same_answers": sum(same(local)[k] == v for k, v in same(remote).items()),
    }


def markdown(rows: list[dict], curve: dict, remote: dict | None, config: dict | None = None) -> str:
    fmt = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [
        "| task | search | in flight | variant | questions | q/min | speedup vs plain | per chunk | accuracy | Δ acc | "
        "answers = plain | speculated | hit rate | saving rate | wasted tok | spec in flight per query (mean / peak) "
        "| early stops | ceiling | ceiling here |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = r.get("same_answers_as_plain")
        lines.append(
            f"| {r['task']} | {r['search']} | {r['in_flight']} | {r['variant']} | {r['problems']} | "
            f"{fmt(r['questions_per_minute'])} | {fmt(r['speedup_vs_plain'])}{_apart(r)} | {_per_chunk(r)} | "
            f"{fmt(r['accuracy'])} | "
            f"{fmt(r['accuracy_delta_vs_plain'])} | {'-' if same is None else f'{same[0]}/{same[1]}'} | "
            f"{r['speculated']} | {fmt(r['hit_rate'])} | "
            f"{fmt(r['saving_rate'])} | {r['wasted_tokens']} | {_budget_use(r)} | {r['stopped_early']} | "
            f"{fmt(_ceiling(r))} | {fmt(r.get('machine_ceiling'))} |"
        )
    sampling = ThoughtSampling(**{k: v for k, v in (config or {}).items() if k in ThoughtSampling.__dataclass_fields__})
    if any(r.get("chunks_apart") for r in rows):
        lines += [
            "",
            "† n of its chunks and plain's were measured in different runs of the benchmark (a variant added to a "
            "finished run, or a run resumed between them): those speedups compare two moments of the machine.",
        ]
    lines += [
        "",
        f"Thoughts sampled at temperature {sampling.thought_temperature:g}, top-p {sampling.thought_top_p:g}; "
        f"evaluations at temperature {sampling.eval_temperature:g}.",
    ]
    sources = sorted({(r["task"], r["data"]) for r in rows if r.get("data")})
    if sources:
        lines += ["", "Questions from: " + "; ".join(f"{task} `{path}`" for task, path in sources) + "."]
    if any(r["search"] in ("rstar", "rest-mcts") and "spex" in r["variant"] for r in rows):
        mode = (config or {}).get("dfs_speculation", "fold")  # runs before the option existed folded
        lines += [
            "",
            f"MCTS speculation: {mode} (exact: the sequential search with its predicted next rollouts pre-run, "
            "the plain search's tree and answers; fold: the paper's extra virtual-loss rollouts folded in as "
            "simulations, a different search).",
        ]
    if any(_ceiling(r) is not None for r in rows):
        lines += [
            "",
            "ceiling (plain BFS rows): the plain trees' level-synchronous time over their critical path, the "
            "speedup perfect speculation with free concurrency would reach on the same trees. ceiling here: "
            "the same trees replayed on this machine's throughput curve below (an expansion decodes at T(n) / n "
            "tokens/s beside n - 1 others), at the reward barriers and with perfect speculation at this k_total "
            "and lookahead: the most SPEX can gain here (`explore/bound.py`).",
        ]
    if curve is not None:
        conc = ", ".join(f"{n}: {t:.0f}" for n, t in zip(curve["concurrency"], curve["tokens_per_second"]))
        lines += ["", f"Local engine throughput (requests in flight: tokens/s): {conc}; k_total = {curve['k_total']}."]
    elif rows:
        lines += ["", f"k_total = {rows[0]['k_total']} (fixed by --fixed-k-total; throughput curve not measured)."]
    if remote is not None:
        lines.append(
            f"Remote path ({remote['task']}, {remote['search']}, {remote['questions']} questions through "
            f"`spectot serve` + the OpenAI backend): {remote['same_answers']}/{remote['questions']} answers "
            f"equal the in-process run's."
        )
    return "\n".join(lines) + "\n"


def _apart(row: dict) -> str:
    """'†n' after a speedup when n of its chunks were measured in another run than plain's same chunk."""
    return f" †{row['chunks_apart']}" if row.get("chunks_apart") and row["variant"] != "plain" else ""


def _per_chunk(row: dict) -> str:
    """The speedup of each chunk over plain's same chunk ('-' for plain and for a single chunk)."""
    speedups = row.get("chunk_speedups") or []
    if row["variant"] == "plain" or len(speedups) < 2:
        return "-"
    return " / ".join(f"{x:.2f}" for x in speedups)


def _budget_use(row: dict) -> str:
    """SPEX's budget use: a query's speculative expansions in flight, on average over its run and at most
    ('-' for records written before it was counted)."""
    if "speculating_mean" not in row:
        return "-"
    return f"{row['speculating_mean']:.2f} / {row['speculating_peak']}"


def _ceiling(row: dict) -> float | None:
    """Only a plain BFS row has one: its expansions all start at their level's barrier."""
    if row["variant"] != "plain" or row["search"] not in BFS:
        return None
    return row.get("speculation_ceiling")


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
