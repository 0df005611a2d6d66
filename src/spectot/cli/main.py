"""The `spectot` command line. The CLI owns the console; library code only logs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from spectot.cli.flags import add_flags, from_flags
from spectot.config import (
    check_tree_tool,
    BackendOptions,
    BenchSpexOptions,
    ServeOptions,
    TreeSearchOptions,
    ThoughtSampling,
    BenchGenerateOptions,
    DraftOptions,
    GenerateOptions,
    ModelOptions,
    SamplingOptions,
    SearchOptions,
    SolveOptions,
    TraceOptions,
    BenchDraftsOptions,
    BenchTotOptions,
    TRAINED_DRAFT_DEFAULTS,
    BenchTreesOptions,
    TrainDraftOptions,
    TreeMeasureOptions,
    TreeProfileOptions,
    TreeSequoiaOptions,
    check_draft,
    check_method,
    DRAFTLESS_ENGINES,
    check_bench,
    is_draft_decoder,
    check_solve,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spectot", description="Lossless speculative acceleration of tree-search reasoning with LLMs."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and library details")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.set_defaults(verbose=False)

    gen = commands.add_parser("generate", help="generate text with ar or speculative decoding")
    for cls in (ModelOptions, DraftOptions, SamplingOptions, GenerateOptions):
        add_flags(gen, cls)

    commands.add_parser("models", help="list model aliases and cached models")

    solve = commands.add_parser(
        "solve", help="tree-search reasoning (ToT-BFS, REBASE, ETS, rStar, REST-MCTS; SPEX) on a task"
    )
    for cls in (ModelOptions, DraftOptions, SearchOptions, SolveOptions, TreeSearchOptions, BackendOptions):
        add_flags(solve, cls)
    serve = commands.add_parser("serve", help="the local engine behind an OpenAI-compatible API")
    for cls in (ModelOptions, DraftOptions, ServeOptions):
        add_flags(serve, cls)
    add_flags(commands.add_parser("trace", help="draw a solve timeline as a Gantt chart"), TraceOptions)

    tree = commands.add_parser("tree", help="token-tree tools")
    tree_commands = tree.add_subparsers(dest="tree_command", required=True)
    add_flags(
        tree_commands.add_parser("sequoia", help="Sequoia's DP-optimal tree for an acceptance vector"),
        TreeSequoiaOptions,
    )
    measure = tree_commands.add_parser(
        "measure", help="measure the positional acceptance vector of a draft on real prompts"
    )
    for cls in (ModelOptions, DraftOptions, TreeMeasureOptions):
        add_flags(measure, cls, TRAINED_DRAFT_DEFAULTS)
    profile = tree_commands.add_parser("profile", help="measure t(n) and the draft step cost c on this machine")
    for cls in (ModelOptions, DraftOptions, TreeProfileOptions):
        add_flags(profile, cls, TRAINED_DRAFT_DEFAULTS)

    train = commands.add_parser("train-draft", help="train an EDD or VDM draft for a target (resumable)")
    for cls in (ModelOptions, TrainDraftOptions):
        add_flags(train, cls)

    bench = commands.add_parser("bench", help="benchmarks that write JSON, Markdown and (but tot) PNG plots")
    bench_commands = bench.add_subparsers(dest="bench", required=True)
    bench_gen = bench_commands.add_parser("generate", help="ar / sd vs transformers generate() on GSM8K")
    for cls in (ModelOptions, BenchGenerateOptions):
        add_flags(bench_gen, cls)
    bench_trees = bench_commands.add_parser(
        "trees", help="chain / SpecInfer / k_config / Sequoia / PCT / VCT / CaPE / EAGLE-2"
    )
    for cls in (ModelOptions, DraftOptions, BenchTreesOptions):
        add_flags(bench_trees, cls, TRAINED_DRAFT_DEFAULTS)
    bench_drafts = bench_commands.add_parser("drafts", help="n-gram / VDM / EDD / EDD + PCT drafts and ablations")
    for cls in (ModelOptions, BenchDraftsOptions):
        add_flags(bench_drafts, cls)
    bench_tot = bench_commands.add_parser("tot", help="SEED's tables: every engine on ToT-BFS tasks, one run")
    for cls in (ModelOptions, DraftOptions, SearchOptions, BenchTotOptions):
        add_flags(bench_tot, cls)
    bench_spex = bench_commands.add_parser("spex", help="SPEX's table: REBASE / rStar +- SPEX +- SD, queries in flight")
    for cls in (ModelOptions, DraftOptions, TreeSearchOptions, ThoughtSampling, BenchSpexOptions):
        add_flags(bench_spex, cls)
    _verbose_everywhere(parser)
    return parser


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """-v after a subcommand too (`spectot generate -v ...`); SUPPRESS keeps a -v given before it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.add_argument(
                    "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="as spectot -v"
                )
                _verbose_everywhere(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        _quiet_transformers()
        # a fresh install's first run builds the native kernels for minutes: say so without -v
        logging.getLogger("spectot.engine.kernels").setLevel(logging.INFO)
    try:
        if hasattr(args, "num_draft_tokens"):  # the command takes the draft flags
            check_draft(from_flags(args, DraftOptions))
        if args.command == "bench" and args.bench in ("trees", "tot", "spex"):
            check_bench(
                args.bench,
                from_flags(args, DraftOptions),
                from_flags(args, SearchOptions) if args.bench == "tot" else None,
                from_flags(args, TreeSearchOptions) if args.bench == "spex" else None,
            )
        if args.command == "generate":
            return _generate(args)
        if args.command == "models":
            return _models()
        if args.command == "solve":
            check_solve(
                from_flags(args, SearchOptions),
                from_flags(args, DraftOptions),
                from_flags(args, SolveOptions),
                from_flags(args, TreeSearchOptions),
                from_flags(args, BackendOptions),
                from_flags(args, ModelOptions),
            )
            return _solve(args) if args.search == "tot-bfs" else _tree_solve(args)
        if args.command == "serve":
            check_method(args.method, from_flags(args, DraftOptions))
            return _serve(
                from_flags(args, ModelOptions), from_flags(args, DraftOptions), from_flags(args, ServeOptions)
            )
        if args.command == "bench" and args.bench == "spex":
            from spectot.bench.spex import run_bench_spex

            run_bench_spex(
                from_flags(args, ModelOptions),
                from_flags(args, DraftOptions),
                from_flags(args, TreeSearchOptions),
                from_flags(args, BenchSpexOptions),
                from_flags(args, ThoughtSampling),
            )
            return 0
        if args.command == "trace":
            return _trace(from_flags(args, TraceOptions))
        if args.command == "tree" and args.tree_command == "sequoia":
            return _tree_sequoia(from_flags(args, TreeSequoiaOptions))
        if args.command == "tree" and args.tree_command in ("measure", "profile"):
            return _tree_tool(args)
        if args.command == "bench" and args.bench == "trees":
            from spectot.bench.trees import run_bench_trees

            run_bench_trees(
                from_flags(args, ModelOptions), from_flags(args, DraftOptions), from_flags(args, BenchTreesOptions)
            )
            return 0
        if args.command == "bench" and args.bench == "tot":
            from spectot.bench.tot import run_bench_tot

            run_bench_tot(
                from_flags(args, ModelOptions),
                from_flags(args, DraftOptions),
                from_flags(args, SearchOptions),
                from_flags(args, BenchTotOptions),
            )
            return 0
        if args.command == "bench" and args.bench == "drafts":
            from spectot.bench.drafts import run_bench_drafts

            run_bench_drafts(from_flags(args, ModelOptions), from_flags(args, BenchDraftsOptions))
            return 0
        if args.command == "train-draft":
            return _train_draft(from_flags(args, ModelOptions), from_flags(args, TrainDraftOptions))
        if args.command == "bench" and args.bench == "generate":
            from spectot.bench.generate import run_bench_generate

            run_bench_generate(from_flags(args, ModelOptions), from_flags(args, BenchGenerateOptions))
            return 0
    except OSError as err:  # a missing file, a directory where a file goes, no permission
        where = f"{err.filename}: " if err.filename else ""
        print(f"spectot: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as err:
        print(f"spectot: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # a long job that saved its progress says so (train-draft)
        print(f"spectot: interrupted{f': {err}' if str(err) else ''}", file=sys.stderr)
        return 130
    return 1


def _solve(args: argparse.Namespace) -> int:
    from rich.console import Console

    from spectot.bench.progress import progress_bar
    from spectot.cli.tables import solve_table
    from spectot.solve import run_solve

    model, draft = from_flags(args, ModelOptions), from_flags(args, DraftOptions)
    search, options = from_flags(args, SearchOptions), from_flags(args, SolveOptions)
    console = Console(stderr=True)
    with progress_bar() as bar:
        task = bar.add_task(f"{options.task} / {options.engine}", total=None)

        def report(done: int, total: int, record: dict) -> None:
            bar.update(task, completed=done, total=total)
            outcome = f"failed: {record['error']}" if record.get("error") else f"answer {record['answer'][:60]!r}"
            bar.console.print(
                f"[{done}/{total}] {record['id']}: grade {record['grade']:.2f}, {record['seconds']:.1f}s, {outcome}"
            )

        run = run_solve(
            model, draft, search, options, report, in_flight=from_flags(args, TreeSearchOptions).queries_in_flight
        )
    summary = run.summary()
    if options.trace and run.timeline is not None:  # none when every problem was resumed
        console.print(f"timeline written to {options.trace} (draw it with `spectot trace {options.trace}`)")
    drafted = "no draft" if options.engine in DRAFTLESS_ENGINES else f"draft {draft.draft}"
    Console().print(solve_table(summary, f"{options.task} / tot-bfs / {options.engine} / {drafted}"))
    return _failures(run.records + run.resumed)


def _tree_solve(args: argparse.Namespace) -> int:
    from rich.console import Console

    from spectot.bench.progress import progress_bar
    from spectot.cli.tables import tree_solve_table
    from spectot.tasks.registry import load_problems, make_task
    from spectot.solve import resume_problems, run_setup
    from spectot.tree_solve import make_backend, make_embedder, run_tree_solve

    model, draft = from_flags(args, ModelOptions), from_flags(args, DraftOptions)
    search, options = from_flags(args, SearchOptions), from_flags(args, SolveOptions)
    tree, backend_options = from_flags(args, TreeSearchOptions), from_flags(args, BackendOptions)
    problems = load_problems(options.task, options.data, options.limit, options.offset, search.seed)  # before the model
    make_task(options.task, search.depth, options.prompt_pool).check_problems(problems)  # before the model too
    setup = run_setup(model, draft, backend_options)
    if options.json and options.resume:  # a resume of another setup is refused before the model loads
        resume_problems(options.json, run_setup(search, tree, options, **setup), True, problems)
    embed = make_embedder(search, tree, model.device)
    backend = make_backend(model, draft, backend_options, tree=tree)
    with progress_bar() as bar:
        task = bar.add_task(f"{options.task} / {search.search} / explore {tree.explore}", total=None)

        def report(done: int, total: int, record: dict) -> None:
            bar.update(task, completed=done, total=total)
            outcome = f"failed: {record['error']}" if record.get("error") else f"answer {record['answer'][:40]!r}"
            bar.console.print(
                f"[{done}/{total}] {record['id']}: score {record['score']:.2f}, {record['seconds']:.1f}s, "
                f"{record['expansions']} expansions, {outcome}"
            )

        run = run_tree_solve(search, tree, options, backend, report, problems=problems, embed=embed, setup=setup)
    title = f"{options.task} / {search.search} / explore {tree.explore} / {backend_options.backend}"
    Console().print(tree_solve_table(run.summary(), title))
    return _failures(run.records + run.resumed)


def _failures(records: list[dict]) -> int:
    """The exit status of a solve run: 1 when some problem failed (its record, written with the others, says
    why), so a script notices; 0 otherwise."""
    failed = [r["id"] for r in records if r.get("error")]
    if not failed:
        return 0
    shown = ", ".join(map(str, failed[:5])) + (", ..." if len(failed) > 5 else "")
    print(
        f"spectot: {len(failed)} of {len(records)} problems failed ({shown}): see their records' error", file=sys.stderr
    )
    return 1


def _serve(model: ModelOptions, draft: DraftOptions, options: ServeOptions) -> int:
    from spectot.backends.local import LocalEngineBackend
    from spectot.pipeline import Pipeline
    from spectot.server.app import bind, serve

    if options.method == "sd" and draft.draft == "none":
        raise ValueError("--method sd decodes with a draft: pass --draft ngram, edd, vdm or a draft model")
    listening = bind(options.host, options.port)  # before the model: a busy port fails at once, and the address
    port = listening.getsockname()[1]  # printed is the one served (port 0 too)
    pipe = Pipeline.from_options(model, draft if options.method == "sd" else DraftOptions(draft="none"))
    backend = LocalEngineBackend.from_pipeline(
        pipe, options.method, options.max_streams, name=model.target, num_draft_tokens=draft.num_draft_tokens
    )
    host = f"[{options.host}]" if ":" in options.host else options.host  # an IPv6 address goes in brackets
    print(f"spectot: serving {model.target} at http://{host}:{port}/v1", file=sys.stderr)
    serve(
        backend,
        options.host,
        port,
        sock=listening,
        max_choices=options.max_choices,
        max_body_mb=options.max_body_mb,
        shutdown_grace=options.shutdown_grace,
    )
    return 0


def _trace(options: TraceOptions) -> int:
    from rich.console import Console

    from spectot.bench.trace import draw_gantt
    from spectot.schedulers.timeline import Timeline

    if not options.file:
        raise ValueError("give the timeline file: spectot trace FILE --out PNG")
    summary = draw_gantt(Timeline.load(options.file), options.out, options.title or Path(options.file).stem)
    Console().print(
        f"{options.out}: target utilisation {100 * summary['target_utilisation']:.1f}% of "
        f"{summary['wall_time']:.2f}s wall time, {summary['verify_intervals']} verifications"
    )
    return 0


def _quiet_transformers() -> None:
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _generate(args: argparse.Namespace) -> int:
    model, draft = from_flags(args, ModelOptions), from_flags(args, DraftOptions)
    sampling, options = from_flags(args, SamplingOptions), from_flags(args, GenerateOptions)
    if options.method == "sd" and draft.draft == "none":
        raise ValueError("--method sd needs a draft: --draft ngram or a draft model (or use --method ar)")
    check_method(options.method, draft)
    from spectot.data.jsonl import read_field
    from spectot.pipeline import Pipeline, PromptError

    prompts = (
        [options.prompt]
        if options.prompt is not None
        else read_field(options.prompts, options.field_name, options.offset + options.limit if options.limit else 0)[
            options.offset :
        ]
    )
    if not prompts:  # an empty file or an --offset past its end: say so before loading a model
        raise ValueError(f"{options.prompts}: no prompts from --offset {options.offset}")
    done = 0
    if options.out:
        from spectot.data.jsonl import resume_outputs

        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        done = resume_outputs(options.out, prompts)
        _check_generation_run(options.out, model, sampling, options, draft, done)
        if done == len(prompts):
            print(f"{options.out}: all {done} prompts already done", file=sys.stderr)
            return 0
    pipe = Pipeline.from_options(model, draft if options.method == "sd" else DraftOptions(draft="none"))
    try:
        outs = pipe.generate(
            prompts[done:],
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.temperature > 0,
            temperature=sampling.temperature or 1.0,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            method=options.method,
            num_draft_tokens=draft.num_draft_tokens,
            stop=sampling.stop,
            seed=sampling.seed,
            batch_size=options.batch_size,
            on_batch=None if options.out is None else _append_outputs(options.out, done, len(prompts)),
            first_index=options.offset + done,
        )
    except PromptError as err:  # raised before any decoding: name the prompt in the user's file
        if options.prompts is None:
            raise
        raise ValueError(f"{options.prompts}: prompt {options.offset + done + err.index + 1} {err.fault}") from None
    if options.out:
        return 0
    if options.json:
        for out in outs:
            print(json.dumps(out.to_dict()))
        return 0
    from rich.console import Console

    from spectot.cli.tables import stats_table

    console = Console()
    for out in outs:
        console.rule(f"[bold]{out.prompt[:80]}")
        console.print(out.text, markup=False, highlight=False)
    console.print(stats_table([o.stats for o in outs], options.method))
    return 0


def _check_generation_run(out: str, model, sampling, options, draft, done: int) -> None:
    """``OUT.run.json`` records what shapes the outputs (target, dtype, sampling, seed, method, draft); a resumed
    run must match it, or the file would mix generations of two setups (a corpus for training, say)."""
    from dataclasses import asdict
    from pathlib import Path

    run = {
        "model": {k: v for k, v in asdict(model).items() if k != "threads"},
        "sampling": asdict(sampling),
        "method": options.method,
        "draft": draft.draft if options.method == "sd" else None,
    }
    record = Path(out + ".run.json")
    if done and not record.exists():  # its setup is unknown: resuming could mix two setups' generations
        raise ValueError(
            f"{out} holds {done} generations but no {record.name} saying what setup made them: write to another "
            "--out (or move the file aside)"
        )
    if done:
        try:
            before = json.loads(record.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            before = err
        if not isinstance(before, dict):  # torn, or not ours: named, not a bare parser message or a traceback
            raise ValueError(f"{record}: not the setup `spectot generate` writes; write to another --out")
        differ = sorted(k for k in run if json.loads(json.dumps(run[k])) != before.get(k))
        if differ:
            raise ValueError(
                f"{out} holds generations of another setup ({', '.join(differ)} differ, see {record}): resume "
                "with the same flags, or write to another --out"
            )
    elif not done:
        partial = record.with_name(record.name + ".partial")  # a kill mid-write leaves no torn setup
        partial.write_text(json.dumps(run, indent=1))
        partial.replace(record)


def _append_outputs(path: str, done: int, total: int) -> Callable[[list], None]:
    """An ``on_batch`` that appends a batch's generations to ``path`` and reports progress on stderr."""
    start, written = time.monotonic(), [done]

    def append(batch: list) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(g.to_dict()) + "\n" for g in batch)
        written[0] += len(batch)
        rate = (written[0] - done) / (time.monotonic() - start)
        eta = (total - written[0]) / rate if rate else float("inf")
        print(f"{path}: {written[0]}/{total} prompts, {rate * 60:.1f}/min, eta {eta / 60:.1f} min", file=sys.stderr)

    return append


def _tree_tool(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from spectot.bench import trees
    from spectot.pipeline import Pipeline

    model, draft = from_flags(args, ModelOptions), from_flags(args, DraftOptions)
    if draft.draft in ("none", "ngram"):
        raise ValueError("tree measure/profile need a model draft with probabilities: --draft edd, vdm or a folder")
    check_tree_tool(args.tree_command, draft)
    if args.tree_command == "measure":
        options = from_flags(args, TreeMeasureOptions)
        if not is_draft_decoder(draft.draft):
            raise ValueError(
                f"tree measure ranks a draft tree's candidates: --draft {draft.draft} drafts a chain (its ranks "
                "2.. would read 0); use edd, vdm or a `spectot train-draft` folder"
            )
        from spectot.data.jsonl import read_field
        from spectot.spec.sampling import SamplingParams

        texts = read_field(options.prompts, options.field_name, options.offset + options.limit)[options.offset :]
        if not texts:
            raise ValueError(f"{options.prompts}: no prompts from --offset {options.offset}")
        # a fixed star: the measurement is of the draft, not of what adaptive k or a grafted lookup branch
        # (ranks past the width) would make of it
        pipe = Pipeline.from_options(
            model, replace(draft, tree="k_config", k_config=str(options.width), adaptive_k=False, lookup=0)
        )
        result = trees.measure_acceptance(
            pipe,
            [pipe.encode(t) for t in texts],
            options.width,
            SamplingParams.from_temperature(options.temperature),
            options.max_new_tokens,
        )
        result.update(temperature=options.temperature, draft=draft.draft, target=model.target, prompts=len(texts))
    else:
        options = from_flags(args, TreeProfileOptions)
        pipe = Pipeline.from_options(model, replace(draft, tree="chain", adaptive_k=False))
        result = trees.profile_costs(pipe, n_max=options.tn_max, depths=options.depths)
        result.update(draft=draft.draft, target=model.target, dtype=model.dtype)
    text = json.dumps(result, indent=1)
    print(text)  # first: the measurement is shown even if the file cannot be written
    if options.out:
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        Path(options.out).write_text(text)
    return 0


def _train_draft(model: ModelOptions, options: TrainDraftOptions) -> int:
    from rich.console import Console

    from spectot.bench.progress import progress_bar
    from spectot.train.job import run_train_draft

    console = Console(stderr=True)
    with progress_bar() as bar:
        tasks: dict[str, int] = {}
        last_line = [0.0]

        def report(stage: str, done: int, total: int, **metrics: float) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            detail = " ".join(f"{k}={v:.3g}" for k, v in metrics.items())
            bar.update(tasks[stage], completed=done, description=f"{stage} {detail}".strip())
            if not console.is_terminal and (time.monotonic() - last_line[0] > 30 or done == total):
                last_line[0] = time.monotonic()  # logs and pipes get a plain line every 30 s
                console.print(f"{stage} {done}/{total} {detail}", markup=False)

        result = run_train_draft(model, options, report)
    for issue in result["corpus"]["skipped_lines"]:
        console.print(f"skipped {issue['path']} line {issue['line']}: {issue['reason']}", markup=False)
    train = result["train"]
    console.print(
        f"{options.kind} draft saved to {options.out}: {train['steps']} steps, {train['tokens']} tokens, "
        f"final loss {train['final_loss']:.4f}, head covers {result['head_coverage']:.1%} of corpus tokens"
    )
    return 0


def _models() -> int:
    from rich.console import Console
    from rich.table import Table

    from spectot.models.registry import ALIASES, alias_path, cached_models, spectot_home

    table = Table(title=f"models (cache: {spectot_home()})")
    for col in ("name", "description", "cached at"):
        table.add_column(col)
    for alias in ALIASES:
        path = alias_path(alias)
        table.add_row(
            alias.name,
            alias.description,
            str(path) if (path / "config.json").exists() else f"not yet ({alias.install})",
        )
    known = {alias_path(a) for a in ALIASES}
    for path in cached_models():
        if path not in known:
            table.add_row(path.name, "cached checkpoint", str(path))
    Console().print(table)
    return 0


def _tree_sequoia(options: TreeSequoiaOptions) -> int:
    import math

    from spectot.config import parse_acceptance
    from spectot.spec.trees.sequoia import sequoia_tree

    acceptance = parse_acceptance(options.acceptance)
    result = sequoia_tree(acceptance, options.budget, options.max_depth or None)
    out: dict = {"parents": result.parents, "expected_tokens": result.expected_tokens}
    if options.profile:
        from spectot.spec.profile import read_profile
        from spectot.spec.trees.sizing import TCurve, choose_tree_size

        profile = read_profile(options.profile, need_draft=True)
        curve = TCurve.from_measurements({p["n"]: p["t"] for p in profile["t_curve"]})
        cost, first = float(profile["c_extra_depth"]), float(profile["c"])
        choice = choose_tree_size(result.table, curve, cost, streams=options.streams, first_draft_cost=first)
        sized = sequoia_tree(acceptance, choice.n, choice.d)
        out = {
            "parents": sized.parents,
            "expected_tokens": sized.expected_tokens,
            "n": choice.n,
            "d": choice.d,
            "streams": choice.streams,
            "predicted_speedup": choice.speedup_vs_ar,
            "draft_cost": cost,
            "first_draft_cost": first,
        }
    if options.json:
        table = [[None if math.isinf(v) else v for v in row[1:]] for row in result.table[1:]]
        print(json.dumps({**out, "G": table, "G_index": "G[n-1][d-1] = best expected tokens for n nodes, depth <= d"}))
        return 0
    from rich.console import Console

    console = Console()
    if "n" in out:
        console.print(
            f"hardware-aware choice for {out['streams']} stream(s): n = {out['n']}, d = {out['d']}, "
            f"predicted speedup {out['predicted_speedup']:.2f}x over AR"
        )
    console.print(f"Sequoia tree: {len(out['parents'])} nodes, expected tokens per step {out['expected_tokens']:.3f}")
    console.print(f"parents: {out['parents']}")
    return 0
