"""`bench tot` end to end on a tiny checkpoint: every engine, one engine per (task, engine) reused across
its problems as `spectot solve --limit N` does, gives `ar`'s trees under greedy decoding; a second run
resumes everything from the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectot.bench.tot import run_bench_tot
from spectot.config import BenchTotOptions, DraftOptions, ModelOptions, SearchOptions

GSM8K = Path(__file__).parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k/test.jsonl")
def test_bench_tot_engines_keep_ar_trees_across_problems_and_resume(tiny_checkpoint, tmp_path) -> None:
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    search = SearchOptions(thought_temperature=0.0, depth=2, thoughts=2)
    opts = BenchTotOptions(gsm8k=str(GSM8K), problems=3, engines="ar,sd,seed-batched", chunk=2, out=str(tmp_path))
    result = run_bench_tot(model, DraftOptions(draft="ngram", num_draft_tokens=3), search, opts)
    assert [r["engine"] for r in result["rows"]] == ["ar", "sd", "seed-batched"]
    assert all(r["problems"] == 3 and r["same_answers_as_ar"] == r["same_paths_as_ar"] == 3 for r in result["rows"])
    assert "| gsm8k | seed-batched |" in (tmp_path / "results.md").read_text()
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    # the engines take turns on chunks of 2 problems (one engine ran all its problems before the next started)
    order = [tuple(json.loads(line)["key"][1:]) for line in lines if json.loads(line)["key"][0] == "gsm8k"]
    assert order == [("ar", 0), ("ar", 1), ("sd", 0), ("sd", 1), ("seed-batched", 0), ("seed-batched", 1)] + [
        ("ar", 2),
        ("sd", 2),
        ("seed-batched", 2),
    ]
    again = run_bench_tot(model, DraftOptions(draft="ngram", num_draft_tokens=3), search, opts)
    assert (tmp_path / "records.jsonl").read_text().splitlines() == lines
    assert json.loads(json.dumps(again["rows"])) == json.loads(json.dumps(result["rows"]))


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k/test.jsonl")
def test_bench_tot_closes_each_continuous_engine_before_the_next(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """A continuous engine left running keeps its worker and its OpenMP pool: every engine after it ran slower."""
    import threading

    import spectot.pipeline

    alive_at_creation: list[int] = []
    make_engine = spectot.pipeline.make_engine

    def counting(*args, **kwargs):
        alive_at_creation.append(sum(t.name == "spectot-engine" for t in threading.enumerate()))
        return make_engine(*args, **kwargs)

    monkeypatch.setattr(spectot.pipeline, "make_engine", counting)
    cleared = []  # each unit starts cold: the engine's own decoder (and its draft's caches) cleared, not only the
    clear = spectot.pipeline.Decoder.clear_prefix_caches  # pipeline's (bench tot passed (engine, method) and
    #                                                       so always found no decoder of the engine)
    monkeypatch.setattr(
        spectot.pipeline.Decoder, "clear_prefix_caches", lambda self: (cleared.append(self), clear(self))
    )
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    search = SearchOptions(thought_temperature=0.0, depth=2, thoughts=2)
    opts = BenchTotOptions(
        gsm8k=str(GSM8K), problems=2, in_flight=2, engines="continuous-ar,continuous-sd,ar", out=str(tmp_path)
    )
    result = run_bench_tot(model, DraftOptions(draft="ngram", num_draft_tokens=3), search, opts)
    assert all(r["same_answers_as_ar"] == 2 for r in result["rows"])
    assert alive_at_creation == [0, 0, 0]  # each engine made with none of the earlier ones running
    assert len({id(d) for d in cleared}) == 3  # the three engines' own decoders, not the pipeline's alone
    assert not any(t.name == "spectot-engine" for t in threading.enumerate())  # nor once the bench returns


def test_a_turn_is_a_chunk_rounded_up_to_the_problems_in_flight() -> None:
    assert BenchTotOptions(problems=10, chunk=3, in_flight=2).turn == 4
    assert BenchTotOptions(problems=10, chunk=5).turn == 5
    assert BenchTotOptions(problems=10, chunk=0).turn == 10  # whole cells
    with pytest.raises(ValueError, match="--chunk counts problems"):
        BenchTotOptions(chunk=-1)


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k/test.jsonl")
def test_a_unit_cut_short_runs_again_whole(tiny_checkpoint, tmp_path) -> None:
    """A continuous engine's unit (its problems in flight at once) stores its counters on its first record: a kill
    between its records left the rest to a later unit, whose counters counted those problems' tokens twice."""
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    search = SearchOptions(thought_temperature=0.0, depth=2, thoughts=2)
    opts = BenchTotOptions(gsm8k=str(GSM8K), problems=2, in_flight=2, engines="continuous-ar", out=str(tmp_path))
    whole = run_bench_tot(model, DraftOptions(draft="none"), search, opts)["rows"][0]
    records = tmp_path / "records.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["key"] == ["gsm8k", "continuous-ar", 1]
    records.write_text("".join(lines[:-1]))  # killed after the unit's first record
    again = run_bench_tot(model, DraftOptions(draft="none"), search, opts)["rows"][0]
    assert again["new_tokens"] == whole["new_tokens"] and again["problems"] == 2


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k/test.jsonl")
def test_more_problems_regrouping_a_unit_run_it_again_whole(tiny_checkpoint, tmp_path) -> None:
    """--problems is left out of a run's identity (problems can be added), but it shapes the continuous engines'
    units: 3 problems 2 in flight are units [0, 1], [2]; 4 are [0, 1], [2, 3]. Problem 2's record kept its
    one-problem counters and 3's got none, so the 4-problem figures lacked 3's tokens."""
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    search = SearchOptions(thought_temperature=0.0, depth=2, thoughts=2)

    def run(problems: int, out: Path) -> dict:
        opts = BenchTotOptions(
            gsm8k=str(GSM8K), problems=problems, in_flight=2, chunk=0, engines="continuous-ar", out=str(out)
        )
        return run_bench_tot(model, DraftOptions(draft="none"), search, opts)["rows"][0]

    run(3, tmp_path / "grown")
    grown = run(4, tmp_path / "grown")
    fresh = run(4, tmp_path / "fresh")
    assert grown["new_tokens"] == fresh["new_tokens"] and grown["problems"] == 4
    assert run(2, tmp_path / "grown")["new_tokens"] == run(2, tmp_path / "fresh2")["new_tokens"]


def test_propose_for_creative_writing_is_refused_before_the_model_loads(tmp_path) -> None:
    """The task's refusal surfaced mid-benchmark, after the other tasks had run."""
    opts = BenchTotOptions(tasks="gsm8k,creative_writing", gsm8k=str(GSM8K), problems=1, out=str(tmp_path))
    model = ModelOptions(target="no-such-model-is-loaded")
    with pytest.raises(ValueError, match="Creative Writing's plans and passages are paragraphs"):
        run_bench_tot(model, DraftOptions(draft="none"), SearchOptions(generation="propose"), opts)


def test_an_engine_measured_in_another_run_than_ar_is_flagged() -> None:
    """An engine added to a finished run compared its time with ar's from another moment of the machine, unmarked."""
    from spectot.bench.tot import markdown, summarise

    def record(run: str) -> dict:
        value = {"answer": "1", "best_state": ["a"], "grade": 1.0, "seconds": 2.0, "in_flight": 1, "components": {}}
        return value | {"run": run}

    ar = [record("A"), record("A")]
    rows = [summarise("gsm8k", "ar", ar, ar), summarise("gsm8k", "sd", [record("A"), record("B")], ar)]
    for row in rows:
        row["speedup_vs_ar"] = 1.0
    assert [r["problems_apart"] for r in rows] == [0, 1]
    table = markdown(rows)
    assert "| gsm8k | sd | 1 | 2 | 4.0 | 0.0 | 1.00 †1 |" in table and "† n of its problems" in table
    assert "†" not in markdown(rows[:1])
