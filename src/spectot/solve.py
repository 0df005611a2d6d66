"""`spectot solve`: run a search over a task's problems with one execution engine.

The job wires the layers: task (``tasks/``) -> policy over a local backend (``search/policy.py``)
-> engine (``schedulers/``) -> decoder (``spec/``). It returns one record per problem (answer, grade,
the searched tree, per-component counters) and a summary; it never prints (the CLI shows progress
through ``report``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spectot.backends.base import is_refusal
from spectot.config import DraftOptions, ModelOptions, SearchOptions, SolveOptions
from spectot.data.jsonl import DataError, results_file
from spectot.search.policy import ComponentStats, LocalBackend, Policy
from spectot.search.tot_bfs import BfsConfig, tot_bfs
from spectot.spec.profile import read_profile
from spectot.tasks.base import Problem
from spectot.tasks.registry import load_problems, make_task

log = logging.getLogger(__name__)


@dataclass
class SolveRun:
    records: list[dict] = field(default_factory=list)
    stats: dict[str, ComponentStats] = field(default_factory=dict)
    seconds: float = 0.0
    timeline: object | None = None
    resumed: list[dict] = field(default_factory=list)  # records an interrupted run of the same setup wrote

    def summary(self) -> dict:
        """This run's problems, times and tokens; ``accuracy_all`` also counts the resumed ones."""
        grades = [r["grade"] for r in self.records]
        every = grades + [r["grade"] for r in self.resumed]
        tokens = sum(c.new_tokens for c in self.stats.values())
        return {
            "problems": len(self.records),
            "failed": sum(bool(r.get("error")) for r in self.records),
            "failed_all": sum(bool(r.get("error")) for r in self.records + self.resumed),
            "resumed": len(self.resumed),
            "accuracy": sum(grades) / len(grades) if grades else 0.0,
            "accuracy_all": sum(every) / len(every) if every else 0.0,
            "seconds": self.seconds,
            "new_tokens": tokens,
            "tokens_per_second": tokens / self.seconds if self.seconds else 0.0,
            "components": {k: c.to_dict() for k, c in self.stats.items()},
        }


def bfs_config(search: SearchOptions) -> BfsConfig:
    return BfsConfig(
        search.breadth, search.thoughts, search.generation, search.evaluation, search.n_votes, search.depth
    )


def run_setup(*options: Any, **more: Any) -> dict:
    """What a run's records depend on, for ``--resume``: every option group's flags but those that only pick
    problems, outputs or speed (limit, offset, files written, threads, timeouts)."""
    skip = {"limit", "offset", "json", "resume", "trace", "generations", "threads", "timeout", "connect_timeout"}
    skip |= {"retries", "base_url"}  # servers: which ones serve the model (--resume against them names it)
    setup = {type(o).__name__: {k: v for k, v in asdict(o).items() if k not in skip} for o in options}
    return {**setup, **more}


def resume_problems(
    path: str, setup: dict, resume: bool, problems: list[Problem]
) -> tuple[list[dict], list[Problem], Callable[[dict], None] | None]:
    """(records already written of ``problems``, problems still to run, appender) for ``--json path`` (no path:
    nothing, all, None). A resumed record of one of ``problems`` must hold the same question; records of other
    problems (a resume with another --limit / --offset) stay in the file and out of this run's figures."""
    if not path:
        return [], problems, None
    done, append = results_file(path, setup, resume)
    by_id = {p.id: p for p in problems}
    for record in done:
        problem = by_id.get(record["id"])
        if problem is not None and record.get("question", problem.question) != problem.question:
            raise DataError(
                f"{path}: problem {record['id']} was another question in the run that wrote it: the data file "
                "changed; write to another file"
            )
    ids = {r["id"] for r in done}
    return [r for r in done if r["id"] in by_id], [p for p in problems if p.id not in ids], append


def _appender(path: str) -> Callable[[dict], None] | None:
    """A callback appending each record as a JSON line to ``path`` (emptied first), or None."""
    if not path:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")

    def append(record: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    return append


def run_solve(
    model: ModelOptions,
    draft: DraftOptions,
    search: SearchOptions,
    options: SolveOptions,
    report: Callable[[int, int, dict], None] | None = None,
    pipe=None,
    engine=None,
    in_flight: int = 1,
) -> SolveRun:
    """Solve ``options.limit`` problems; ``report(done, total, record)`` after each one. ``pipe``: a
    loaded Pipeline to reuse (benchmarks run several engines on one model); ``engine``: an
    ``(engine, method)`` pair from ``make_engine`` on that pipe to reuse (it keeps what it learned, such as
    the adaptive draft length's acceptance estimate, as it does across one run's problems).
    ``in_flight``: problems searched at once, each on its own thread, their requests sharing the forwards
    of a continuous engine (> 1 needs one); every problem's tree is the one it gets alone."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from spectot.engine.openmp import release_thread_pool
    from spectot.pipeline import Pipeline, make_engine
    from spectot.schedulers.timeline import Timeline

    task = make_task(options.task, search.depth, options.prompt_pool)
    problems = load_problems(options.task, options.data, options.limit, options.offset, search.seed)
    task.check_problems(problems)
    setup = run_setup(model, draft, search, options)  # before the model loads: a refused resume costs nothing
    resumed, problems, write = resume_problems(options.json, setup, options.resume, problems)
    costs = read_profile(options.profile) if options.profile else None
    if not problems:  # all resumed: nothing to load the model for
        log.info("every problem has its record in %s already", options.json)
        return SolveRun(resumed=resumed)
    if pipe is None:
        pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    owned = engine is None  # an engine made here is closed here (a continuous one holds a thread)
    engine, method = engine or make_engine(pipe, options.engine, draft, model, costs)
    if in_flight > 1 and not hasattr(engine, "run_chained"):
        raise ValueError(
            f"--queries-in-flight {in_flight} needs a continuous engine (continuous-ar, continuous-sd): "
            f"'{options.engine}' runs one level at a time"
        )
    timeline = Timeline() if options.trace else None
    backend = LocalBackend(
        lambda prompt: pipe.encode(prompt, chat=task.chat),
        pipe.decoder.detokenize,
        engine,
        method,
        draft.num_draft_tokens,
        timeline,
        _appender(options.generations),
    )
    policy = Policy(backend, search.seed, search.thought_temperature, search.eval_temperature, search.thought_top_p)
    run = SolveRun(stats=backend.stats, timeline=timeline, resumed=resumed)

    def solve(problem: Problem) -> dict:
        t = time.perf_counter()
        gold = problem.answer if isinstance(problem.answer, (str, list)) else str(problem.answer)
        try:
            result = tot_bfs(task, problem, policy, bfs_config(search))
        except Exception as err:
            if is_refusal(err):  # a prompt past the context, say: this problem fails, the others go on
                log.warning("problem %s failed: %s", problem.id, err)
                return {
                    **{"id": problem.id, "answer": "", "best_state": [], "best_value": 0.0, "levels": []},
                    "question": problem.question,
                    "gold": gold,
                    "grade": 0.0,
                    "seconds": time.perf_counter() - t,
                    "engine": options.engine,
                    "error": str(err),
                }
            if isinstance(err, ValueError):  # name the problem it came from
                raise ValueError(f"problem {problem.id}: {err}") from err
            raise
        return {
            **result.to_dict(),
            "question": problem.question,
            "gold": gold,
            "grade": task.grade(problem, result.answer),
            "seconds": time.perf_counter() - t,
            "engine": options.engine,
        }

    t0 = time.perf_counter()
    release_thread_pool()  # the problem threads (or the engine's) run the model from here on
    try:
        with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="spectot-problem") as pool:
            # each record written as its problem finishes: in problem order, a problem behind a slow one waited
            # unwritten, and a failure or a kill lost every record held back so (--resume ran them again)
            futures = {pool.submit(solve, problem): i for i, problem in enumerate(problems)}
            finished: dict[int, dict] = {}
            failure: BaseException | None = None
            try:
                for future in as_completed(futures):
                    if future.cancelled():
                        continue
                    error = future.exception()
                    if error is not None:
                        if failure is None:  # the first: problems not started yet are not started
                            failure = error
                            for other in futures:
                                other.cancel()
                        continue
                    finished[futures[future]] = record = future.result()
                    if write is not None:
                        write(record)
                    if report is not None:
                        report(len(finished), len(problems), record)
            except BaseException:  # Ctrl-C, a full disk: the pool would run every queued problem before it stops
                for other in futures:
                    other.cancel()
                raise
            if failure is not None:
                raise failure
            run.records = [finished[i] for i in range(len(problems))]  # in problem order
    finally:
        if owned:
            getattr(engine, "close", lambda: None)()
    run.seconds = time.perf_counter() - t0
    if timeline is not None:
        timeline.save(options.trace)
    return run
