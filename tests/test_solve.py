"""`spectot solve --generations`: every generation of a ToT-BFS run is written with its token ids, and
the file is a `spectot train-draft` corpus."""

from __future__ import annotations

import json

import pytest

from spectot.backends.base import Completion, CompletionRequest
from spectot.config import DraftOptions, ModelOptions, SearchOptions, SolveOptions, TreeSearchOptions
from spectot.solve import run_solve
from spectot.train.draft import read_corpus
from spectot.tree_solve import run_tree_solve


def test_generations_are_recorded_per_stream_and_read_as_a_corpus(tiny_checkpoint, tmp_path) -> None:
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    path = tmp_path / "gen" / "generations.jsonl"
    options = SolveOptions(task="gsm8k", limit=2, engine="batched-ar", generations=str(path))
    search = SearchOptions(depth=2, thoughts=2, thought_top_p=0.9)
    run = run_solve(model, DraftOptions(draft="none"), search, options)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_component = {c: [r for r in records if r["component"] == c] for c in ("TG", "SE")}
    assert {c: len(rs) for c, rs in by_component.items()} == {c: run.stats[c].streams for c in ("TG", "SE")}
    assert sum(len(r["token_ids"]) for r in records) == sum(c.new_tokens for c in run.stats.values())
    assert {(r["temperature"], r["top_p"]) for r in by_component["TG"]} == {(1.0, 0.9)}
    assert {(r["temperature"], r["top_p"]) for r in by_component["SE"]} == {(0.0, 1.0)}
    sequences, issues = read_corpus([str(path)], lambda t: [], lambda t: [], max_len=10_000)
    assert not issues
    assert sequences == [
        r["prompt_ids"] + r["token_ids"] for r in records if len(r["prompt_ids"] + r["token_ids"]) >= 2
    ]


class RecordingBackend:
    """Answers every thought "The answer is 3." and every rating "7"; keeps the requests."""

    name = "recording"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []

    async def complete(self, request: CompletionRequest) -> Completion:
        self.requests.append(request)
        rating = request.max_tokens == 8  # the GSM8K task's rating request (gsm8k.rating_request)
        return Completion("7" if rating else "The answer is 3.", "stop", 3, 1)

    async def aclose(self) -> None:
        pass


def test_tree_searches_sample_thoughts_and_evaluations_as_asked() -> None:
    backend = RecordingBackend()
    search = SearchOptions(search="rebase", thought_temperature=0.7, thought_top_p=0.95, eval_temperature=0.3)
    run_tree_solve(search, TreeSearchOptions(budget=2), SolveOptions(task="gsm8k", limit=1), backend)
    sampled = {(r.max_tokens == 8, r.temperature, r.top_p) for r in backend.requests}
    assert sampled == {(False, 0.7, 0.95), (True, 0.3, 1.0)}


@pytest.mark.parametrize(
    "bad", [dict(thought_temperature=-1.0), dict(eval_temperature=float("nan")), dict(thought_top_p=0.0)]
)
def test_bad_sampling_settings_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="thought|eval"):
        SearchOptions(**bad)


def test_generations_of_an_async_search_are_refused(tmp_path) -> None:
    options = SolveOptions(generations=str(tmp_path / "g.jsonl"))
    with pytest.raises(ValueError, match="--search tot-bfs"):
        run_tree_solve(SearchOptions(search="rebase"), TreeSearchOptions(), options, backend=None)
    assert not (tmp_path / "g.jsonl").exists()


def test_problems_in_flight_build_the_trees_each_gets_alone(tiny_checkpoint) -> None:
    """Three problems searched at once on the continuous engine (sampled thoughts, their requests in
    shared forwards) give record for record the trees serial ar builds one problem at a time."""
    from spectot.pipeline import Pipeline

    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    search = SearchOptions(depth=2, thoughts=2, breadth=2)
    runs = {}
    for engine, in_flight in (("ar", 1), ("continuous-ar", 3)):
        options = SolveOptions(task="gsm8k", limit=3, engine=engine)
        runs[engine] = run_solve(model, DraftOptions(draft="none"), search, options, pipe=pipe, in_flight=in_flight)
    trees = {e: [(r["id"], r["levels"], r["answer"]) for r in run.records] for e, run in runs.items()}
    assert trees["continuous-ar"] == trees["ar"]
    for c in ("TG", "SE"):  # every generation counted once
        assert runs["continuous-ar"].stats[c].new_tokens == runs["ar"].stats[c].new_tokens
    with pytest.raises(ValueError, match="continuous engine"):
        run_solve(model, DraftOptions(draft="none"), search, SolveOptions(engine="batched-ar"), pipe=pipe, in_flight=2)


def test_ets_clusters_steps_with_the_embedder_it_is_given() -> None:
    """The embedder reaches ETS's width rule (it was the trigram stand-in whatever was asked)."""
    import numpy as np

    seen: list[list[str]] = []

    def embed(texts):
        seen.append(list(texts))
        return np.eye(len(texts))

    search, tree = SearchOptions(search="ets", depth=2), TreeSearchOptions(budget=3, cluster_threshold=0.1)
    run_tree_solve(search, tree, SolveOptions(task="gsm8k", limit=1), RecordingBackend(), embed=embed)
    assert seen and all(t == "The answer is 3." for texts in seen for t in texts)


def test_an_interrupted_solve_resumes_where_it_stopped(tiny_checkpoint, tmp_path) -> None:
    """--resume: the problems whose records made it to --json are not run again, a torn last record is cut and
    its problem runs again, and the file ends as an uninterrupted run's; another setup is refused."""
    from spectot.data.jsonl import DataError

    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    search = SearchOptions(depth=2, thoughts=2)
    whole = tmp_path / "whole.jsonl"
    run_solve(model, DraftOptions(draft="none"), search, SolveOptions(engine="ar", limit=3, json=str(whole)))
    lines = whole.read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    run_solve(model, DraftOptions(draft="none"), search, SolveOptions(engine="ar", limit=3, json=str(cut)))
    cut.write_text(lines[0] + "\n" + lines[1][:40])  # killed while writing the second record
    options = SolveOptions(engine="ar", limit=3, json=str(cut), resume=True)
    run = run_solve(model, DraftOptions(draft="none"), search, options)
    assert run.summary()["resumed"] == 1 and len(run.records) == 2
    keep = ("id", "answer", "levels", "grade")
    assert [{k: json.loads(x)[k] for k in keep} for x in cut.read_text().splitlines()] == [
        {k: json.loads(x)[k] for k in keep} for x in lines
    ]
    import spectot.pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("every problem was resumed: nothing to load the model for")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spectot.pipeline.Pipeline, "from_options", no_load)
        done = run_solve(model, DraftOptions(draft="none"), search, options)
    assert done.summary()["resumed"] == 3 and done.records == []
    with pytest.raises(DataError, match=r"another setup \(SearchOptions differ"):
        run_solve(model, DraftOptions(draft="none"), SearchOptions(depth=2, thoughts=3), options)
    (tmp_path / "cut.jsonl.run.json").unlink()
    with pytest.raises(DataError, match="no cut.jsonl.run.json beside it"):
        run_solve(model, DraftOptions(draft="none"), search, options)
    with pytest.raises(ValueError, match="already holds results"):
        SolveOptions(json=str(cut))  # without --resume a file of results is not emptied


def test_a_tree_search_resumes_without_asking_the_backend_again(tmp_path) -> None:
    out = tmp_path / "rebase.jsonl"
    search, tree = SearchOptions(search="rebase", depth=2), TreeSearchOptions(budget=2)
    first = RecordingBackend()
    run_tree_solve(search, tree, SolveOptions(task="gsm8k", limit=2, json=str(out)), first)
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n")
    again = RecordingBackend()
    options = SolveOptions(task="gsm8k", limit=2, json=str(out), resume=True)
    run = run_tree_solve(search, tree, options, again)
    assert run.summary()["resumed"] == 1 and len(run.records) == 1
    assert 0 < len(again.requests) < len(first.requests)
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [json.loads(x)["id"] for x in lines]
    # a resume asking for fewer problems reports those: the records of the others stay in the file, out of its
    # figures (all 6 of a finished run were counted in accuracy_all of a --limit 2 resume)
    fewer = run_tree_solve(search, tree, SolveOptions(task="gsm8k", limit=1, json=str(out), resume=True), again)
    assert fewer.summary()["resumed"] == 1 and fewer.records == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "an object with a 't_curve' list"),
        ("{", "cannot read it"),
        ('{"t_curve": [{"n": 2, "t": 1}]}', "start at n = 1"),
    ],
)
def test_a_bad_profile_is_refused_before_the_model_loads(text, message, tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(text)
    model = ModelOptions(target=str(tmp_path / "no-model"))  # never loaded: the profile is read first
    with pytest.raises(ValueError, match=message):
        run_solve(model, DraftOptions(draft="none"), SearchOptions(), SolveOptions(profile=str(path), limit=1))


def test_the_tree_searches_local_backend_drafts_the_tokens_asked(tiny_checkpoint) -> None:
    """--num-draft-tokens reached neither the tree searches' local engine nor serve's (always 5)."""
    from spectot.config import BackendOptions
    from spectot.tree_solve import make_backend

    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    draft = DraftOptions(draft="ngram", num_draft_tokens=2, adaptive_k=False)
    backend = make_backend(model, draft, BackendOptions(method="sd"))
    try:
        assert backend.num_draft_tokens == 2
    finally:
        backend.engine.close()


def test_problems_in_flight_are_written_as_they_finish(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """Records came back in problem order: a problem finished behind a failing (or slow) one was held unwritten,
    and the failure that ends the run (here a grader that breaks on problem 1) lost it (--resume ran it again)."""
    from spectot.tasks.gsm8k import Gsm8kTask

    data = tmp_path / "mixed.jsonl"
    lines = [{"question": " ".join(["w5"] * 500), "answer": "#### 4"}, {"question": "w1 w2", "answer": "#### 3"}]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    grade = Gsm8kTask.grade

    def broken_on_1(self, problem, answer):
        if problem.id == "1":
            raise RuntimeError("the grader broke")
        return grade(self, problem, answer)

    monkeypatch.setattr(Gsm8kTask, "grade", broken_on_1)
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    out = tmp_path / "records.jsonl"
    options = SolveOptions(task="gsm8k", data=str(data), limit=2, engine="continuous-ar", json=str(out))
    with pytest.raises(RuntimeError, match="the grader broke"):
        run_solve(model, DraftOptions(draft="none"), SearchOptions(depth=2, thoughts=1), options, in_flight=2)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["2"]


def test_a_resume_against_servers_must_name_the_model(tmp_path) -> None:
    """The servers' URLs are left out of a run's setup (more servers of one model resume it), so with no
    --served-model a resume against another server (another model) mixed two models' records."""
    from spectot.config import BackendOptions, TreeSearchOptions, check_solve

    out = tmp_path / "r.jsonl"
    search, options = SearchOptions(search="rebase"), SolveOptions(json=str(out), resume=True)
    servers = ("http://a:8000/v1",)
    with pytest.raises(ValueError, match="--resume against servers needs --served-model"):
        check_solve(
            search, DraftOptions(), options, TreeSearchOptions(), BackendOptions(backend="openai", base_url=servers)
        )
    named = BackendOptions(backend="openai", base_url=servers, served_model="m")
    check_solve(search, DraftOptions(), options, TreeSearchOptions(), named)


def test_an_interrupted_run_does_not_go_on_with_its_queued_problems(tiny_checkpoint, monkeypatch) -> None:
    """A Ctrl-C (here: the report raising) left every queued problem to run before the pool let go."""
    import spectot.solve as solve_module

    real, started = solve_module.tot_bfs, []

    def counting(*args, **kwargs):
        started.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(solve_module, "tot_bfs", counting)

    def interrupt(done: int, total: int, record: dict) -> None:
        raise KeyboardInterrupt

    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    options = SolveOptions(task="gsm8k", limit=8, engine="continuous-ar")
    with pytest.raises(KeyboardInterrupt):
        run_solve(
            model, DraftOptions(draft="none"), SearchOptions(depth=2, thoughts=1), options, interrupt, in_flight=2
        )
    assert len(started) <= 3  # the two in flight, and perhaps one that started as the first finished


def test_the_bfs_figures_are_left_out_of_an_mcts_summary() -> None:
    """level_seconds / speculation_ceiling (the wait at BFS's reward barriers) were reported for rStar runs too."""
    tree = TreeSearchOptions(budget=2)
    rstar = run_tree_solve(
        SearchOptions(search="rstar", depth=2), tree, SolveOptions(task="gsm8k", limit=1), RecordingBackend()
    )
    assert rstar.summary()["level_seconds"] is None and rstar.summary()["speculation_ceiling"] is None
    rebase = run_tree_solve(
        SearchOptions(search="rebase", depth=2), tree, SolveOptions(task="gsm8k", limit=1), RecordingBackend()
    )
    assert rebase.summary()["level_seconds"] > 0


def _problems_with_one_too_long(path) -> str:
    """Three GSM8K lines; the second question is 2,100 words, past the tiny models' 2,048-token context."""
    questions = ["w5 w6 w7?", " ".join(["w9"] * 2100) + "?", "w8 w9?"]
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n" for q in questions))
    return str(path)


@pytest.mark.parametrize("engine", ["ar", "continuous-ar"])
def test_a_problem_past_the_context_fails_alone(tiny_checkpoint, tmp_path, engine) -> None:
    """A problem whose prompt the model cannot hold ended the whole run (and a --resume met it again, first);
    now its record says why, graded 0, and the other problems are solved as before."""
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    data = _problems_with_one_too_long(tmp_path / "q.jsonl")
    search = SearchOptions(depth=2, thoughts=2)
    out = tmp_path / "out.jsonl"
    options = SolveOptions(engine=engine, data=data, limit=3, json=str(out))
    run = run_solve(model, DraftOptions(draft="none"), search, options, in_flight=2 if "continuous" in engine else 1)
    by_id = {r["id"]: r for r in run.records}
    assert run.summary()["failed"] == 1 and len(by_id) == 3
    failed = by_id["2"]
    assert (failed["answer"], failed["grade"]) == ("", 0.0) and "exceeds the model's context" in failed["error"]
    assert not by_id["1"].get("error") and not by_id["3"].get("error") and by_id["1"]["levels"]
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["1", "2", "3"]
    alone = run_solve(model, DraftOptions(draft="none"), search, SolveOptions(engine=engine, data=data, limit=1))
    assert alone.records[0]["answer"] == by_id["1"]["answer"]


class RefusingBackend(RecordingBackend):
    """``RecordingBackend``, refusing every request of a question holding "w9 w9" as a server does a prompt past
    its model's context (or, with ``error``, failing it otherwise)."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.error = error

    async def complete(self, request: CompletionRequest) -> Completion:
        if "w9 w9" in request.prompt:
            from spectot.backends.openai import OpenAIBackendError

            raise self.error or OpenAIBackendError("maximum context length is 2048 tokens", 400, "http://x/v1")
        return await super().complete(request)


@pytest.mark.parametrize("search", ["rebase", "rstar"])
def test_a_tree_search_query_refused_by_its_server_fails_alone(tmp_path, search) -> None:
    data = _problems_with_one_too_long(tmp_path / "q.jsonl")
    options = SolveOptions(task="gsm8k", data=data, limit=3)
    tree = TreeSearchOptions(budget=2, queries_in_flight=3)
    run = run_tree_solve(SearchOptions(search=search, depth=2), tree, options, RefusingBackend())
    by_id = {r["id"]: r for r in run.records}
    assert run.summary()["failed"] == 1 and by_id["2"]["score"] == 0.0 and by_id["2"]["answer"] == ""
    assert "maximum context length" in by_id["2"]["error"]
    assert by_id["1"]["answer"] == by_id["3"]["answer"] == "3" and not by_id["1"]["error"]
    with pytest.raises(RuntimeError, match="engine stopped"):  # anything else still ends the run
        run_tree_solve(
            SearchOptions(search=search, depth=2), tree, options, RefusingBackend(RuntimeError("engine stopped"))
        )


def test_which_errors_are_a_requests_own() -> None:
    from spectot.backends.base import is_refusal
    from spectot.backends.openai import OpenAIBackendError
    from spectot.spec.decoding import PromptRefused

    assert is_refusal(PromptRefused("prompt 0 has 9000 tokens"))
    assert is_refusal(OpenAIBackendError("too long", 400)) and is_refusal(OpenAIBackendError("too large", 413))
    for other in (OpenAIBackendError("no key", 401), OpenAIBackendError("down", 503), OpenAIBackendError("gone")):
        assert not is_refusal(other)
    assert not is_refusal(ValueError("a bug")) and not is_refusal(RuntimeError("out of memory"))


def test_a_query_that_fails_leaves_none_of_its_expansions_running(tmp_path) -> None:
    """Refused on its first request, a query's record came back while its sibling thoughts (and their ratings)
    still ran at primary priority on the shared backend, unowned."""
    import asyncio

    finished: list[str] = []

    class FirstRefused(RecordingBackend):
        refused = False

        async def complete(self, request: CompletionRequest) -> Completion:
            if "w9 w9" in request.prompt:
                if not self.refused:
                    from spectot.spec.decoding import PromptRefused

                    self.refused = True
                    raise PromptRefused("prompt 0 has 2105 tokens; it exceeds the model's context")
                await asyncio.sleep(0.1)
                finished.append(request.prompt)
            else:  # the other queries run on meanwhile, several levels of 0.05 s requests
                await asyncio.sleep(0.05)
            return await super().complete(request)

    data = _problems_with_one_too_long(tmp_path / "q.jsonl")
    tree = TreeSearchOptions(budget=4, queries_in_flight=3)
    run = run_tree_solve(
        SearchOptions(search="rebase", depth=2), tree, SolveOptions(data=data, limit=3), FirstRefused()
    )
    assert run.summary()["failed"] == 1 and finished == []


def test_a_benchmark_refuses_to_compare_work_that_failed() -> None:
    from spectot.bench.records import refuse_failures

    refuse_failures([{"id": "1", "answer": "3"}], "bench tot")
    with pytest.raises(ValueError, match=r"bench tot: 1 problem\(s\) failed \(2; problem 2: too long\)"):
        refuse_failures([{"id": "1", "answer": "3"}, {"id": "2", "answer": "", "error": "too long"}], "bench tot")


def test_a_tree_search_names_the_problem_whose_bad_input_ended_the_run(tmp_path) -> None:
    """A chat template that refuses one problem's prompt ends the run (it is no context overflow to record), and
    the error named no problem."""
    data = _problems_with_one_too_long(tmp_path / "q.jsonl")
    backend = RefusingBackend(ValueError("the chat template refused the prompt: roles must alternate"))
    with pytest.raises(ValueError, match="problem 2: the chat template refused the prompt"):
        run_tree_solve(
            SearchOptions(search="rebase", depth=2),
            TreeSearchOptions(budget=2),
            SolveOptions(data=data, limit=3),
            backend,
        )
