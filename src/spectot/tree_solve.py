"""`spectot solve --search rebase|ets|rstar|rest-mcts`: tree searches over an async backend, with SPEX.

The job wires the layers: task (``tasks/``) -> expansions over a backend (``backends/``: the local
continuous engine, or OpenAI-compatible servers) -> search (``search/bfs.py``, ``search/mcts.py``)
-> exploration (``explore/``: SPEX on or off, queries in flight). One record per query, in finishing
order, and a summary; it never prints (the CLI reports progress through ``report``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spectot.config import BackendOptions, DraftOptions, ModelOptions, SearchOptions, SolveOptions, TreeSearchOptions
from spectot.explore.queries import ExploreConfig, run_queries
from spectot.search.ets import Embed
from spectot.search.expansion import NEXT, PRIMARY, ExpansionSampling
from spectot.search.tree_search import TreeSearchConfig
from spectot.solve import resume_problems, run_setup
from spectot.tasks.base import Problem
from spectot.tasks.registry import load_problems, make_task

logger = logging.getLogger(__name__)


@dataclass
class TreeSolveRun:
    records: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    engine: dict = field(default_factory=dict)  # the local engine's counters (steps, most live streams)
    resumed: list[dict] = field(default_factory=list)  # records an interrupted run of the same setup wrote

    def summary(self) -> dict:
        """This run's problems, times and counters; ``accuracy_all`` also counts the resumed ones."""
        n = len(self.records)
        every = [r["score"] for r in self.records + self.resumed]
        spec = [r["spec"] for r in self.records]
        total = lambda key: sum(s.get(key, 0) for s in spec)  # noqa: E731
        speculated, used = total("speculated"), total("expansions_used")
        # BFS figures: an MCTS tree has no levels to wait at (a record without its search, a benchmark's, keeps them)
        bfs = any(r.get("search", "rebase") in ("rebase", "ets") for r in self.records)
        levels = sum(r["result"].get("level_seconds", 0.0) for r in self.records) if bfs else None
        critical = sum(r["result"].get("critical_path_seconds", 0.0) for r in self.records) if bfs else None
        query_seconds = sum(r["seconds"] for r in self.records)
        return {
            "problems": n,
            "failed": sum(bool(r.get("error")) for r in self.records),
            "failed_all": sum(bool(r.get("error")) for r in self.records + self.resumed),
            "resumed": len(self.resumed),
            "accuracy": sum(r["score"] for r in self.records) / n if n else 0.0,
            "accuracy_all": sum(every) / len(every) if every else 0.0,
            "seconds": self.seconds,
            "questions_per_minute": 60 * n / self.seconds if self.seconds else 0.0,
            "tokens": sum(r["tokens"] for r in self.records),
            "expansions": sum(r["expansions"] for r in self.records),
            "stopped_early": sum(r["stopped_early"] for r in self.records),
            "speculated": speculated,
            "hit_rate": total("hits") / speculated if speculated else 0.0,
            "saving_rate": total("saved_expansions") / used if used else 0.0,  # expansions, as SpecCounters
            "wasted_tokens": total("wasted_tokens"),
            "cancelled": total("cancelled"),
            # budget use, per query: its speculative expansions in flight, on average over its run and at most
            "speculating_mean": total("speculative_seconds") / query_seconds if query_seconds else 0.0,
            "speculating_peak": max((s.get("budget_peak", 0) for s in spec), default=0),
            # BFS: the level-synchronous time of the trees found over their critical path, the speedup
            # perfect speculation with free concurrency would reach on them (search/tree_search.py)
            "level_seconds": levels,
            "critical_path_seconds": critical,
            "speculation_ceiling": levels / critical if levels is not None and critical else None,
            "engine": self.engine,
        }


def tree_config(search: SearchOptions, tree: TreeSearchOptions, embed: Embed | None = None) -> TreeSearchConfig:
    return TreeSearchConfig(
        search.search,
        tree.budget,
        tree.balance_temperature,
        search.depth,
        max_children=tree.max_children,
        rest_children=tree.rest_children,
        rest_alpha=tree.rest_alpha,
        lambda_kv=tree.lambda_kv,
        lambda_cov=tree.lambda_cov,
        cluster_threshold=tree.threshold,
        embed=embed,
        dfs_speculation=tree.dfs_speculation,
    )


def make_embedder(search: SearchOptions, tree: TreeSearchOptions, device: str = "cpu") -> Embed | None:
    """ETS's sentence embedder (``--ets-embedder``), loaded; None for the trigram stand-in or another search."""
    if search.search != "ets" or not tree.ets_embedder:
        return None
    from spectot.models.embedder import load_embedder
    from spectot.models.loader import resolve_device

    return load_embedder(tree.ets_embedder, resolve_device(device))


def explore_config(tree: TreeSearchOptions) -> ExploreConfig:
    return ExploreConfig(
        tree.explore,
        tree.k_total,
        tree.lookahead,
        tree.retract,
        tau=tree.tau,
        wake_up=tree.budget_wakeup,
        early_stop=tree.early_stop,
        min_answers=tree.min_answers,
        alpha=tree.alpha,
    )


def make_backend(
    model: ModelOptions, draft: DraftOptions, options: BackendOptions, pipe=None, tree: TreeSearchOptions | None = None
):
    """The async backend the options name: the local engine over ``pipe`` (loaded if None), its fill rows and
    drafting of speculative requests from ``tree``, or servers."""
    if options.backend == "openai":
        from spectot.backends.openai import OpenAIBackend

        return OpenAIBackend.from_urls(
            options.base_url,
            options.served_model or None,
            options.timeout,
            options.retries,
            connect_timeout=options.connect_timeout,
        )
    from spectot.backends.local import LocalEngineBackend
    from spectot.pipeline import Pipeline, samples_its_drafts

    if pipe is None:
        pipe = Pipeline.from_options(model, draft if options.method == "sd" else DraftOptions(draft="none"))
    tree = tree or TreeSearchOptions()
    if tree.explore == "spex" and options.method == "sd" and samples_its_drafts(pipe.proposer):
        logger.warning(
            "a sampling draft (%s): SPEX's searches keep the plain search's distribution, not its very trees "
            "(whether a step drafts changes which sample comes out); a deterministic draft (ngram, or a trained "
            "draft with --tree-children top) keeps the trees",
            type(pipe.proposer).__name__,
        )
    return LocalEngineBackend.from_pipeline(
        pipe,
        options.method,
        options.max_streams,
        name=model.target,
        fill_rows=tree.fill_rows,
        draft_priority=draft_priority(tree),
        num_draft_tokens=draft.num_draft_tokens,
    )


def draft_priority(tree: TreeSearchOptions) -> int | None:
    """The highest request priority the local engine drafts for, from ``--sd-requests``."""
    return {"primary": PRIMARY, "next": NEXT, "all": None}[tree.sd_requests]


def run_tree_solve(
    search: SearchOptions,
    tree: TreeSearchOptions,
    options: SolveOptions,
    backend,
    report: Callable[[int, int, dict], None] | None = None,
    close: bool = True,
    problems: list[Problem] | None = None,
    embed: Embed | None = None,
    setup: dict | None = None,
) -> TreeSolveRun:
    """Solve ``options.limit`` problems with ``tree.queries_in_flight`` at once; ``report(done, total,
    record)`` after each; ``close``: close the backend at the end (in the loop that used it). ``problems``:
    the ones ``options`` names, loaded already (the CLI reads them before the model loads); ``embed``: ETS's
    embedder, loaded already (else ``make_embedder`` loads it); ``setup``: what the records depend on beyond
    these options (the model, draft and backend flags: ``solve.run_setup``), kept for ``--resume``."""
    if options.generations:
        raise ValueError(f"--generations records --search tot-bfs runs; --search {search.search} does not write it")
    task = make_task(options.task, search.depth, options.prompt_pool)
    if problems is None:
        problems = load_problems(options.task, options.data, options.limit, options.offset, search.seed)
    task.check_problems(problems)
    setup = run_setup(search, tree, options, **(setup or {"backend": getattr(backend, "name", "")}))
    resumed, problems, write = resume_problems(options.json, setup, options.resume, problems)
    questions = {p.id: p.question for p in problems}
    run = TreeSolveRun(resumed=resumed)
    embed = embed or make_embedder(search, tree)

    async def main() -> None:
        records = run_queries(
            task,
            problems,
            backend,
            tree_config(search, tree, embed),
            explore_config(tree),
            tree.queries_in_flight,
            tree.reward,
            search.seed,
            ExpansionSampling(search.thought_temperature, search.thought_top_p, search.eval_temperature),
        )
        try:
            async for record in records:
                row = {
                    **record.to_dict(),
                    "question": questions[record.id],
                    "search": search.search,
                    "explore": tree.explore,
                }
                run.records.append(row)
                if write is not None:
                    write(row)
                if report is not None:
                    report(len(run.records), len(problems), row)
        finally:
            if close:
                await backend.aclose()

    t0 = time.perf_counter()
    asyncio.run(main())
    run.seconds = time.perf_counter() - t0
    counters = getattr(getattr(backend, "engine", None), "counters", None)
    run.engine = dict(vars(counters)) if counters is not None else {}
    return run
