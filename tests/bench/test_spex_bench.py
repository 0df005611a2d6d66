"""`bench spex` end to end on a tiny checkpoint: every cell is recorded, the table and JSON are
written, a second run resumes from the records, and the remote path (spectot serve + the OpenAI
backend over loopback) gives the in-process answers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spectot.bench.spex import chunk_starts, run_bench_spex, write_results
from spectot.explore.bound import per_request_rate, speculation_bound
from spectot.config import BenchSpexOptions, DraftOptions, ModelOptions, TreeSearchOptions

GSM8K = Path(__file__).parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k/test.jsonl")
def test_bench_spex_runs_resumes_and_checks_the_remote_path(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    import spectot.pipeline

    built = []  # the sd variants' adaptive draft length: one fresh per chunk, from costs recorded once (it was timed
    make = spectot.pipeline.adaptive_draft_length  # by each process and learnt across chunks and variants)
    monkeypatch.setattr(spectot.pipeline, "adaptive_draft_length", lambda *a: built.append(make(*a)) or built[-1])
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    opts = BenchSpexOptions(
        gsm8k=str(GSM8K),
        math500="",
        problems=3,
        searches="rebase",
        in_flight="1",
        chunk=2,  # chunks of questions 1-2 and 3: the variants take turns on each
        variants="plain,spex,sd,spex+es",
        fixed_k_total=8,  # a tiny model's measured curve is timing noise (k_total 2-4 here): speculate for sure
        out=str(tmp_path),
    )
    tree = TreeSearchOptions(budget=2)
    result = run_bench_spex(model, DraftOptions(draft="ngram"), tree, opts)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["plain", "spex", "sd", "spex+es"]
    assert all(r["problems"] == 3 for r in result["rows"])
    assert rows["spex"]["speculated"] > 0
    assert rows["spex"]["speculating_mean"] > 0 < rows["spex"]["speculating_peak"] <= 8  # within k_total
    assert rows["plain"]["speculating_mean"] == 0 == rows["plain"]["speculating_peak"]
    # early termination is asked of the es cell only (the tiny model's thoughts reach no answer to vote on)
    assert [r["early_stop"] for r in rows.values()] == [False, False, False, True]
    with pytest.raises(ValueError, match="drop --early-stop"):
        run_bench_spex(model, DraftOptions(draft="ngram"), replace(tree, early_stop=True), opts)
    assert result["remote"]["same_answers"] == result["remote"]["questions"] == 3
    assert (tmp_path / "results.png").stat().st_size > 0
    table = (tmp_path / "results.md").read_text()
    assert "| gsm8k | rebase | 1 | spex |" in table
    assert "k_total = 8 (fixed" in table and result["concurrency"] is None  # no throughput sweep when fixed
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    keys = [key[3:] for key in (json.loads(line)["key"] for line in lines) if len(key) == 5]
    # chunk j starts with variant j: no variant always runs first
    assert keys == [[v, 0] for v in ("plain", "spex", "sd", "spex+es")] + [
        [v, 2] for v in ("spex", "sd", "spex+es", "plain")
    ]
    assert (
        len(built) == len({id(b) for b in built}) == 8
        and [json.loads(line)["key"] for line in lines].count(["costs"]) == 1
    )
    first_chunk = json.loads(lines[1])["value"]["queries"]
    assert all(len(q["result"]["tree"]) == q["expansions"] for q in first_chunk)  # kept for the replayed ceiling
    again = run_bench_spex(model, DraftOptions(draft="ngram"), tree, opts)  # everything from the records
    assert (tmp_path / "records.jsonl").read_text().splitlines() == lines
    assert json.loads(json.dumps(again["rows"])) == json.loads(json.dumps(result["rows"]))


def test_chunks_take_turns_and_a_running_cell_compares_on_the_chunks_it_has(tmp_path) -> None:
    assert list(chunk_starts(40, 10, 1)) == [0, 10, 20, 30]
    assert list(chunk_starts(40, 10, 8)) == [0, 16, 32]  # at least two rounds of the queries in flight
    assert list(chunk_starts(40, 0, 4)) == [0]  # whole cells

    def chunk(first: int, seconds: float, right: int) -> dict:
        queries = [
            {"id": f"q{first + i}", "answer": "1", "score": float(i < right), "seconds": seconds / 2, "tokens": 10}
            | {"expansions": 3, "stopped_early": False, "spec": {}, "result": {}}
            for i in range(2)
        ]
        return {"seconds": seconds, "engine": {"steps": 5, "max_live": 2}, "queries": queries}

    records = {}
    for variant, first, seconds, right in [("plain", 0, 8.0, 1), ("plain", 2, 6.0, 0), ("spex", 0, 4.0, 2)]:
        records[("gsm8k", "rebase", 1, variant, first)] = chunk(first, seconds, right) | {
            "k_total": 4,
            "early_stop": False,
        }
    opts = BenchSpexOptions(problems=4, chunk=2, out=str(tmp_path))
    rows = {r["variant"]: r for r in write_results(tmp_path, records, [], {}, opts)["rows"]}
    assert rows["plain"]["problems"] == 4 and rows["plain"]["seconds"] == 14.0
    assert rows["spex"]["problems"] == 2  # one chunk so far
    assert rows["spex"]["speedup_vs_plain"] == 2.0  # 8 s against 4 s on questions 1-2, not 14 s on 1-4
    assert rows["spex"]["accuracy_delta_vs_plain"] == 0.5  # 2/2 against 1/2 there
    assert rows["spex"]["chunk_speedups"] == [2.0]
    records[("gsm8k", "rebase", 1, "spex", 2)] = chunk(2, 5.0, 0) | {"k_total": 4, "early_stop": False}
    rows = {r["variant"]: r for r in write_results(tmp_path, records, [], {}, opts)["rows"]}
    assert rows["spex"]["chunk_speedups"] == [2.0, 1.2] and rows["spex"]["speedup_vs_plain"] == 14.0 / 9.0
    assert "| 1.56 | 2.00 / 1.20 |" in (tmp_path / "results.md").read_text()  # each chunk's own, in turn
    assert rows["spex"]["chunks_apart"] == 0 and "†" not in (tmp_path / "results.md").read_text()
    # a variant's chunk measured in another run than plain's same chunk (added to a finished run): flagged
    records[("gsm8k", "rebase", 1, "spex", 2)]["run"] = "later"
    rows = {r["variant"]: r for r in write_results(tmp_path, records, [], {}, opts)["rows"]}
    assert rows["spex"]["chunks_apart"] == 1
    assert "| 1.56 †1 | 2.00 / 1.20 |" in (tmp_path / "results.md").read_text()


def test_a_plain_bfs_row_gets_its_trees_replayed_on_the_throughput_curve(tmp_path) -> None:
    trees = [[[-1, 3], [-1, 1], [1, 2], [0, 1]], [[-1, 2], [-1, 2], [0, 4]]]
    queries = [
        {"id": str(i), "answer": "1", "score": 1.0, "seconds": 1.0, "tokens": 7, "expansions": len(tree)}
        | {"stopped_early": False, "spec": {}, "result": {"tree": tree}}
        for i, tree in enumerate(trees)
    ]
    chunk = {"seconds": 2.0, "engine": {}, "queries": queries, "k_total": 2, "early_stop": False}
    records = {("gsm8k", "rebase", 1, "plain", 0): chunk, ("gsm8k", "rstar", 1, "plain", 0): chunk}
    curve = {"concurrency": [1, 2, 4], "tokens_per_second": [10.0, 16.0, 20.0], "sweeps": []}
    records[("concurrency",)] = curve
    opts = BenchSpexOptions(problems=2, chunk=0, out=str(tmp_path))
    rows = write_results(tmp_path, records, [], {"lookahead": 1}, opts)["rows"]
    rate = per_request_rate(curve["concurrency"], curve["tokens_per_second"])
    expected = speculation_bound([[tuple(n) for n in t] for t in trees], rate, 1, 2, 1)
    assert 1.0 < expected < 1.25
    assert rows[0]["search"] == "rebase" and rows[0]["machine_ceiling"] == pytest.approx(expected)
    assert "machine_ceiling" not in rows[1]  # rStar has no level barriers to replay
    assert f"| {expected:.2f} |" in (tmp_path / "results.md").read_text()


def test_unknown_variants_are_refused_before_the_output_folder_is_made(tmp_path) -> None:
    """They were refused inside the run, after its output folder was made (left empty)."""
    from spectot.config import BenchSpexOptions

    with pytest.raises(ValueError, match="--variants: choose from plain, spex"):
        BenchSpexOptions(variants="plain,spex-nowake", out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
