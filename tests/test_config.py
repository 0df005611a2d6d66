"""Typed options refuse impossible or conflicting flags up front, naming the flag (no model is loaded here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typing import get_args

from spectot.config import (
    BackendOptions,
    BenchDraftsOptions,
    BenchSpexOptions,
    BenchTotOptions,
    BenchTreesOptions,
    DraftOptions,
    EngineName,
    GenerateOptions,
    ModelOptions,
    SamplingOptions,
    SearchOptions,
    ServeOptions,
    SolveOptions,
    TrainDraftOptions,
    TreeMeasureOptions,
    TreeSearchOptions,
    TreeSequoiaOptions,
    check_draft,
    check_solve,
    parse_acceptance,
)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SamplingOptions(temperature=float("inf")), "--temperature must be a finite"),
        (lambda: SearchOptions(thought_temperature=float("nan")), "--thought-temperature must be a finite"),
        (lambda: TreeSearchOptions(alpha=float("inf")), "--alpha must be a finite"),
        (lambda: TreeSearchOptions(lambda_kv=-1.0), "--lambda-kv"),
        (lambda: BackendOptions(timeout=float("nan")), "--timeout must be a finite"),
        (lambda: check_draft(DraftOptions(draft="ngram", tree="pct")), "--draft ngram has none"),
        (lambda: check_draft(DraftOptions(draft="org/draft", tree="k_config")), "the draft model org/draft drafts"),
        # a shape flag of another tree than --tree's was ignored
        (lambda: check_draft(DraftOptions(draft="edd", tree="pct", k_config="4,2")), "--k-config shape other trees"),
        (lambda: check_draft(DraftOptions(draft="edd", tree="chain", tree_budget=32)), "--tree chain would not"),
        (lambda: check_draft(DraftOptions(draft="edd", tree="k_config", pct_threshold=0.2)), "--pct-threshold"),
        (lambda: check_draft(DraftOptions(draft="edd", tree="eagle2", specinfer="2x4")), "--specinfer shape"),
        (
            lambda: DraftOptions(draft="edd", tree="pct", tree_budget=100_000),
            r"--tree-budget must be in \[1, 1024\]",
        ),
        (lambda: TreeSequoiaOptions(acceptance="0.6,0.2", budget=100_000), r"--budget must be in \[1, 1024\]"),
        (lambda: TreeSequoiaOptions(acceptance="0.6,0.2", streams=4), "pass --profile with it"),  # was ignored
        (lambda: SamplingOptions(stop=("",)), "--stop '' would stop before the first token"),
        (lambda: SamplingOptions(top_p=0.5), "--temperature 0 decodes greedily"),  # greedy read no top-p
        (lambda: ModelOptions(threads=99_999), "--threads must be in"),
        (lambda: DraftOptions(draft="edd", tree="sequoia", acceptance="garbage"), "neither a file"),
        (lambda: DraftOptions(draft="edd", tree="sequoia", acceptance="0.9,0.9"), "summing to <= 1"),
        (lambda: DraftOptions(draft="edd", tree="eagle2", tree_children="with_replacement"), "independent"),
        (lambda: DraftOptions(draft="edd", tree="pct", tree_children="without_replacement"), "independent"),
        (lambda: DraftOptions(draft="edd", tree="cape", tree_children="without_replacement"), "independent"),
        (lambda: GenerateOptions(prompt="hi", limit=5), "--offset and --limit pick prompts"),
        (lambda: GenerateOptions(prompts="p.jsonl", out="o.jsonl", json=True), "pick one"),
        (lambda: BenchTotOptions(tasks="gsm8k,bogus"), "--tasks: choose from"),
        (lambda: BenchTotOptions(engines="ar,warp"), "--engines: choose from"),
        (lambda: BenchSpexOptions(searches="tot-bfs"), "--searches: choose from"),
        (lambda: BenchSpexOptions(in_flight="1,0"), "--in-flight"),
        (lambda: BenchSpexOptions(gsm8k="", math500=""), "--gsm8k and --math500 are both empty"),
        (lambda: TreeSearchOptions(rest_children=0), "--rest-children must be >= 1, got 0"),
        (lambda: BenchTreesOptions(temperatures="0,hot"), "--temperatures"),
        (lambda: BenchTreesOptions(chain_k=0), "--chain-k"),
        (lambda: BenchDraftsOptions(k=0), "--k and --max-new-tokens"),
        (lambda: BenchDraftsOptions(lookup=-1), "--lookup"),
        (lambda: TreeMeasureOptions(temperature=-1.0), "--temperature"),
        (lambda: ServeOptions(port=70000), "--port"),
        (lambda: ServeOptions(max_streams=0), "--max-streams"),
        (lambda: ServeOptions(max_body_mb=float("inf")), "--max-body-mb must be a number > 0"),  # crashed in create_app
        (lambda: TrainDraftOptions(corpus=("c.jsonl",), token_lr=-1.0), "--token-lr"),
        (lambda: TrainDraftOptions(corpus=("c.jsonl",), epochs=float("inf")), "--epochs must be a finite"),
    ],
)
def test_impossible_flags_are_refused_by_name(make, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        make()


def test_acceptance_file_with_non_numbers_is_a_clear_error(tmp_path: Path) -> None:
    for values in (["0.5", "0.2"], [True, False], 0.5):
        path = tmp_path / "acceptance.json"
        path.write_text(json.dumps({"acceptance": values}))
        with pytest.raises(ValueError, match="probabilities"):
            parse_acceptance(str(path))


def test_train_draft_checks_its_corpus_and_output_before_loading_anything(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory"):
        TrainDraftOptions(corpus=(str(tmp_path),), out=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="no such file"):
        TrainDraftOptions(corpus=(str(tmp_path / "missing.jsonl"),), out=str(tmp_path / "out"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "w1 w2"}\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"an earlier job")
    with pytest.raises(ValueError, match="pass --resume"):
        TrainDraftOptions(corpus=(str(corpus),), out=str(out))
    assert TrainDraftOptions(corpus=(str(corpus),), out=str(out), resume=True).resume


def test_solve_does_not_empty_an_earlier_runs_results(tmp_path: Path) -> None:
    earlier = tmp_path / "run.jsonl"
    earlier.write_text('{"id": "gsm8k-0"}\n')
    with pytest.raises(ValueError, match="already holds results"):
        SolveOptions(json=str(earlier))
    with pytest.raises(ValueError, match="already holds results"):
        SolveOptions(generations=str(earlier))
    with pytest.raises(ValueError, match="is a directory"):
        SolveOptions(json=str(tmp_path))
    assert SolveOptions(json=str(tmp_path / "new.jsonl")).json  # a new file (or an empty one) is fine


def accepted_or_refused(check, args: tuple, message: str | None) -> None:
    """``check(*args)`` passes when ``message`` is None, else raises a ValueError matching it."""
    if message is None:
        check(*args)
        return
    with pytest.raises(ValueError, match=message):
        check(*args)


@pytest.mark.parametrize(
    ("search", "draft", "solve", "tree", "backend", "message"),
    [
        ("tot-bfs", "ngram", {}, {}, {"backend": "openai", "base_url": ("http://h/v1",)}, "--backend openai"),
        ("tot-bfs", "ngram", {}, {"explore": "spex"}, {}, "--explore spex"),
        ("tot-bfs", "none", {"engine": "seed-batched"}, {}, {}, "--engine seed-batched drafts"),
        ("tot-bfs", "ngram", {"engine": "mcsd"}, {}, {}, "--engine mcsd verifies k_config trees"),  # ran chain SD
        ("tot-bfs", "edd", {"engine": "mcsd"}, {}, {}, None),
        ("tot-bfs", "ngram", {"engine": "continuous-sd", "trace": "t.json"}, {}, {}, "keeps none"),  # empty trace
        ("tot-bfs", "ngram", {"engine": "seed", "trace": "t.json"}, {}, {}, None),
        ("tot-bfs", "ngram", {"engine": "seed"}, {"queries_in_flight": 4}, {}, "needs a continuous engine"),
        ("rebase", "ngram", {"generations": ""}, {}, {"method": "sd"}, None),
        ("rebase", "none", {}, {}, {"method": "sd"}, "--method sd decodes with a draft"),
        ("rebase", "ngram", {}, {"ets_embedder": "x/y"}, {"method": "sd"}, "use them with --search ets"),
        ("tot-bfs", "ngram", {}, {"cluster_threshold": 0.1}, {}, "use them with --search ets"),
        ("ets", "ngram", {}, {"ets_embedder": "x/y", "cluster_threshold": 0.1}, {"method": "sd"}, None),
        # flags the run would not read (they were accepted and ignored)
        ("tot-bfs", "ngram", {}, {"budget": 16, "reward": "logprob"}, {}, "--budget, --reward configure the tree"),
        ("tot-bfs", "ngram", {}, {}, {"method": "sd"}, "--method configure the tree searches"),
        ("tot-bfs", "edd", {"engine": "ar"}, {}, {}, "--engine ar decodes without a draft"),
        ("tot-bfs", "none", {"engine": "hf-batched-ar"}, {}, {}, None),
        ("rebase", "ngram", {"trace": "t.json"}, {}, {}, "--trace configure --search tot-bfs"),
        ("rebase", "ngram", {"engine": "continuous-sd"}, {}, {}, "--engine configure --search tot-bfs"),
        ("rebase", "ngram", {}, {"max_children": 5}, {}, "--max-children belong to another search"),
        ("rstar", "ngram", {}, {"lambda_kv": 2.0}, {}, "--lambda-kv belong to another search"),
        ("rstar", "ngram", {}, {"rest_children": 3}, {}, "--rest-children belong to another search"),
        ("rstar", "ngram", {}, {"rest_alpha": 0.3}, {}, "--rest-alpha belong to another search"),
        ("rest-mcts", "ngram", {}, {"rest_alpha": 0.3}, {}, None),
        ("rebase", "ngram", {}, {"k_total": 4}, {}, "--k-total configure SPEX's speculation"),
        ("rebase", "ngram", {}, {"k_total": 4, "explore": "spex"}, {}, None),
        ("rebase", "ngram", {}, {}, {"base_url": ("http://h/v1",)}, "--base-url configure --backend openai"),
        ("rebase", "edd", {}, {}, {}, "--draft edd drafts for --method sd"),
        (
            "rebase",
            "ngram",
            {},
            {},
            {"backend": "openai", "base_url": ("http://h/v1",), "max_streams": 8},
            "--max-streams configure the local engine",
        ),
        ("rebase", "ngram", {}, {}, {"backend": "openai", "base_url": ("http://h/v1",)}, None),
    ],
)
def test_solve_flag_combinations(search, draft, solve, tree, backend, message, tmp_path: Path) -> None:
    options = (
        SearchOptions(search=search),
        DraftOptions(draft=draft),
        SolveOptions(**solve),
        TreeSearchOptions(**tree),
        BackendOptions(**backend),
    )
    accepted_or_refused(check_solve, options, message)


@pytest.mark.parametrize(
    "model, draft, message",
    [
        (
            {"target": "qwen2.5-7b"},
            {},
            "--target names the local model; --backend openai asks the servers for --served",
        ),
        ({"dtype": "fp32", "kernels": "torch"}, {}, "--dtype, --kernels configure the local engine"),
        ({"chat_template": False}, {}, "--no-chat-template configure the local engine"),
        ({}, {"num_draft_tokens": 8, "adaptive_k": False}, "--num-draft-tokens, --no-adaptive-k configure the local"),
        ({"device": "cpu", "threads": 2}, {}, None),  # the ETS embedder's device, torch's threads: read
    ],
)
def test_the_openai_backend_refuses_the_local_models_flags(model, draft, message) -> None:
    """--backend openai read none of them, and --target was misleading: the servers' first model was asked for."""
    options = (
        SearchOptions(search="rebase"),
        DraftOptions(**draft),
        SolveOptions(),
        TreeSearchOptions(),
        BackendOptions(backend="openai", base_url=("http://h/v1",)),
        ModelOptions(**model),
    )
    accepted_or_refused(check_solve, options, message)


@pytest.mark.parametrize(
    "draft, message",
    [
        ({"draft": "ngram", "draft_head": 100}, "--draft-head configure spectot's trained drafts"),
        ({"draft": "ngram", "lookup": 5, "coupled": False}, "--lookup, --no-coupled configure spectot's trained"),
        ({"draft": "edd", "ngram_max": 5}, "--ngram-max configure the n-gram draft; --draft edd"),
        ({"draft": "edd", "draft_head": 100, "lookup": 3}, None),
        ({"draft": "ngram", "ngram_width": 3}, None),
    ],
)
def test_flags_of_another_kind_of_draft_are_refused(draft, message) -> None:
    """generate / serve / solve ran the n-gram draft with --draft-head, a trained one with --ngram-max, in silence."""
    from spectot.config import check_method

    accepted_or_refused(check_method, ("sd", DraftOptions(**draft)), message)


def test_spex_tau_is_a_flag_of_spex() -> None:
    """The allocation's tau had no flag (always 1): now --tau, refused where nothing speculates, reaching the run."""
    from spectot.tree_solve import explore_config

    assert explore_config(TreeSearchOptions(explore="spex", tau=0.5)).tau == 0.5
    with pytest.raises(ValueError, match="--tau must be >= 0"):
        TreeSearchOptions(tau=-1.0)
    from spectot.tree_solve import tree_config

    assert tree_config(SearchOptions(search="rest-mcts"), TreeSearchOptions(rest_alpha=0.3)).rest_alpha == 0.3
    for alpha, message in [(1.5, "--rest-alpha weighs two values"), (float("nan"), "--rest-alpha must be a finite")]:
        with pytest.raises(ValueError, match=message):
            TreeSearchOptions(rest_alpha=alpha)
    options = (
        SearchOptions(search="rebase"),
        DraftOptions(),
        SolveOptions(),
        TreeSearchOptions(tau=2.0),
        BackendOptions(),
    )
    with pytest.raises(ValueError, match="--tau configure SPEX's speculation"):
        check_solve(*options)


def test_a_draftless_engine_refuses_draft_flags() -> None:
    """solve --engine ar --num-draft-tokens 9 was accepted and read nothing."""
    options = (
        SearchOptions(),
        DraftOptions(num_draft_tokens=9),
        SolveOptions(engine="ar"),
        TreeSearchOptions(),
        BackendOptions(),
    )
    with pytest.raises(ValueError, match="--num-draft-tokens shape speculative decoding; --engine ar"):
        check_solve(*options)


def test_output_paths_that_could_not_be_written_are_refused_before_the_work(tmp_path: Path) -> None:
    """A --trace under a file, or a folder as --out, failed after the whole run (its results lost)."""
    from spectot.config import TraceOptions, TreeProfileOptions

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="afile is a file, not a folder"):
        SolveOptions(trace=str(afile / "trace.json"))
    for make in (TreeMeasureOptions, TreeProfileOptions, lambda out: TraceOptions(file="t.json", out=out)):
        with pytest.raises(ValueError, match="is a directory, expected a file"):
            make(out=str(tmp_path))
    assert SolveOptions(trace=str(tmp_path / "new" / "deeper" / "trace.json")).trace  # folders to be made: fine


def test_the_trace_charts_format_is_named_by_its_suffix(tmp_path: Path) -> None:
    """`trace --out chart` wrote a PNG named 'chart'; `--out chart.jpgx` failed in matplotlib after the drawing."""
    from spectot.config import TraceOptions

    for out in ("chart", "chart.jpgx"):
        with pytest.raises(ValueError, match=r"name the chart \.png, \.pdf or \.svg"):
            TraceOptions(file="t.json", out=str(tmp_path / out))
    assert all(TraceOptions(file="t.json", out=str(tmp_path / f"c.{s}")) for s in ("png", "PDF", "svg"))


def test_identical_votes_are_refused() -> None:
    """--n-votes 3 at --eval-temperature 0 cast three copies of one greedy vote."""
    options = (DraftOptions(), SolveOptions(), TreeSearchOptions(), BackendOptions())
    with pytest.raises(ValueError, match="casts 3 identical votes"):
        check_solve(SearchOptions(evaluation="vote", n_votes=3), *options)
    check_solve(SearchOptions(evaluation="vote", n_votes=3, eval_temperature=0.7), *options)
    check_solve(SearchOptions(evaluation="vote", n_votes=1), *options)


def test_flags_a_run_would_ignore_are_refused(tmp_path) -> None:
    """Each of these was accepted and ignored in silence (a black-box review of the CLI)."""
    options = (DraftOptions(), SolveOptions(), TreeSearchOptions(), BackendOptions())
    with pytest.raises(ValueError, match="--n-votes counts --evaluation vote's votes; --evaluation value would not"):
        check_solve(SearchOptions(n_votes=5), *options)
    check_solve(SearchOptions(), *options)
    with pytest.raises(ValueError, match="--thought-temperature 0 decodes greedily"):
        SearchOptions(thought_temperature=0.0, thought_top_p=0.5)
    assert SearchOptions(thought_temperature=0.0).thought_top_p == 1.0
    with pytest.raises(ValueError, match=r"a number in \[0, 2\]"):
        TreeSearchOptions(cluster_threshold=2.5)
    assert TreeSearchOptions(cluster_threshold=2.0).threshold == 2.0
    with pytest.raises(ValueError, match="--field names a field of --prompts FILE; --prompt TEXT would not"):
        GenerateOptions(prompt="hi", field_name="q")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = str(tmp_path / "d")
    for flags, named in (
        (dict(hidden_layer=-2), "--hidden-layer"),
        (dict(token_lr=1e-3), "--token-lr"),
        (dict(hidden_states=False), "--no-hidden-states"),
    ):
        with pytest.raises(ValueError, match=f"{named} configure.* --kind vdm"):
            TrainDraftOptions(kind="vdm", corpus=(str(corpus),), out=out, **flags)
    with pytest.raises(ValueError, match="--token-lr is the learning rate of --next-token"):
        TrainDraftOptions(corpus=(str(corpus),), out=out, token_lr=1e-3)
    TrainDraftOptions(corpus=(str(corpus),), out=out, token_lr=1e-3, next_token=True)
    with pytest.raises(ValueError, match="--base-url notaurl: expected http"):
        BackendOptions(backend="openai", base_url=("http://localhost:8000/v1", "notaurl"))


def test_tree_depth_counts_draft_depths_for_every_tree() -> None:
    """--tree-depth 3: three draft tokens deep below the pending root, for Sequoia as for PCT (Sequoia's DP
    counts the root: --tree-depth 3 gave it two)."""
    from spectot.pipeline import make_tree_policy

    sequoia, _ = make_tree_policy(
        DraftOptions(draft="edd", tree="sequoia", tree_depth=3, tree_budget=12, acceptance="0.6,0.2,0.1")
    )
    parents = sequoia.shape
    depth = [0] * len(parents)
    for node, parent in enumerate(parents[1:], start=1):
        depth[node] = depth[parent] + 1
    assert max(depth) == 3
    pct, _ = make_tree_policy(DraftOptions(draft="edd", tree="pct", tree_depth=3))
    assert pct.max_depth == 3
    one, _ = make_tree_policy(
        DraftOptions(draft="edd", tree="sequoia", tree_depth=1, tree_budget=4, acceptance="0.6,0.2,0.1")
    )
    assert list(one.shape) == [-1, 0, 0, 0]  # --tree-depth 1 is a star (it was refused: "needs depth >= 2")


def test_a_draft_that_names_nothing_is_refused_before_any_model_loads() -> None:
    from spectot.config import check_draft

    with pytest.raises(ValueError, match="--draft egd: not a draft; use none, ngram, edd, vdm"):
        check_draft(DraftOptions(draft="egd"))
    for fine in ("none", "ngram", "edd", "vdm", "smollm2-135m", "HuggingFaceTB/SmolLM2-360M-Instruct"):
        check_draft(DraftOptions(draft=fine))


def test_benchmarks_refuse_the_flags_they_set_themselves() -> None:
    from spectot.config import check_bench

    with pytest.raises(ValueError, match="--draft ngram drafts none"):
        check_bench("trees", DraftOptions(), None, None)
    with pytest.raises(ValueError, match="--tree, --k-config: bench trees sets them"):
        check_bench("trees", DraftOptions(draft="edd", tree="k_config", k_config="2,2"), None, None)
    with pytest.raises(ValueError, match="bench tot runs ToT-BFS"):
        check_bench("tot", DraftOptions(), SearchOptions(search="rebase"), None)
    with pytest.raises(ValueError, match="--k-total: bench spex sets them"):
        check_bench("spex", DraftOptions(), None, TreeSearchOptions(k_total=3))
    check_bench("trees", DraftOptions(draft="edd"), None, None)
    check_bench("spex", DraftOptions(), None, TreeSearchOptions())


def test_bench_tot_runs_the_engines_its_draft_allows() -> None:
    """``all`` leaves out what the draft cannot run; a named engine it cannot run is refused before any work
    (make_engine refused it halfway through the run, after the engines before it were measured)."""
    every = BenchTotOptions()
    assert every.engine_names("edd") == list(get_args(EngineName))
    assert "mcsd" not in every.engine_names("ngram") and "seed" in every.engine_names("ngram")
    assert every.engine_names("none") == ["ar", "batched-ar", "hf-batched-ar", "continuous-ar"]
    with pytest.raises(ValueError, match="--engine mcsd verifies"):
        BenchTotOptions(engines="ar,mcsd").engine_names("ngram")
    with pytest.raises(ValueError, match="--engine sd drafts"):
        BenchTotOptions(engines="ar,sd").engine_names("none")


def test_a_trees_own_shape_flags_pass() -> None:
    check_draft(DraftOptions(draft="edd", tree="sequoia", acceptance="0.6,0.2", tree_budget=32, tree_depth=4))
    check_draft(DraftOptions(draft="edd", tree="pct", pct_threshold=0.2, tree_depth=5))
    check_draft(DraftOptions(draft="edd", tree="eagle2", tree_budget=24))
    check_draft(DraftOptions(draft="edd", k_config="4,2", tree_budget=32))  # auto: the engine's tree may read them


def _depth(parents) -> int:
    depth = [0] * len(parents)
    for node, parent in enumerate(parents[1:], start=1):
        depth[node] = depth[parent] + 1
    return max(depth)


def test_a_tree_deeper_than_a_step_drafts_is_planned_within_it_or_refused() -> None:
    """A step drafts at most --num-draft-tokens (k) deep: Sequoia's unbounded optimum for this vector (12 deep) was
    cut at 5, unlike its plan (a reviewer's figures: G 4.99 planned, 3.95 drafted, the optimum within 5: 4.35),
    and a SpecInfer 5x8 lost its last 3 tokens per sequence, in silence. Sequoia's DP now plans within k; a shape
    deeper than k is refused by name."""
    from spectot.pipeline import make_tree_policy

    vector = "0.8,0.1,0.05"
    within, _ = make_tree_policy(DraftOptions(draft="edd", tree="sequoia", acceptance=vector))
    assert _depth(within.shape) == 5 and len(within.shape) == 16
    deep, _ = make_tree_policy(DraftOptions(draft="edd", tree="sequoia", acceptance=vector, num_draft_tokens=16))
    assert _depth(deep.shape) == 12
    refused = [
        (dict(tree="specinfer", specinfer="5x8"), "--specinfer 5x8 drafts 8 tokens deep, .* --num-draft-tokens 8"),
        (dict(tree="k_config", k_config="2,1,1,1,1,1"), "--k-config 2,1,1,1,1,1 drafts 6 .* --num-draft-tokens 6"),
        (dict(tree="pct", tree_depth=7), "--tree-depth 7 drafts 7 .* --num-draft-tokens 7"),
    ]
    for flags, message in refused:
        with pytest.raises(ValueError, match=message):
            DraftOptions(draft="edd", **flags)
    assert DraftOptions(draft="edd", tree="specinfer", specinfer="5x8", num_draft_tokens=8).num_draft_tokens == 8
