"""`bench spex` end to end on a tiny checkpoint: every cell is recorded, the table and JSON are
written, a second run resumes from the records, and the remote path (spectot serve + the OpenAI
backend over loopback) gives the in-process answers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spectot.bench.spex import run_bench_spex
from spectot.config import BenchSpexOptions, DraftOptions, ModelOptions, TreeSearchOptions

GSM8K = Path(__file__).parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k/test.jsonl")
def test_bench_spex_runs_resumes_and_checks_the_remote_path(tiny_checkpoint, tmp_path) -> None:
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    opts = BenchSpexOptions(
        gsm8k=str(GSM8K),
        math500="",
        problems=2,
        searches="rebase",
        in_flight="2",
        variants="plain,spex,sd,spex+es",
        fixed_k_total=8,  # a tiny model's measured curve is timing noise (k_total 2-4 here): speculate for sure
        out=str(tmp_path),
    )
    tree = TreeSearchOptions(budget=2)
    result = run_bench_spex(model, DraftOptions(draft="ngram"), tree, opts)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["plain", "spex", "sd", "spex+es"]
    assert all(r["problems"] == 2 for r in result["rows"])
    assert rows["spex"]["speculated"] > 0
    assert rows["spex"]["speculating_mean"] > 0 < rows["spex"]["speculating_peak"] <= 8  # within k_total
    assert rows["plain"]["speculating_mean"] == 0 == rows["plain"]["speculating_peak"]
    # early termination is asked of the es cell only (the tiny model's thoughts reach no answer to vote on)
    assert [r["early_stop"] for r in rows.values()] == [False, False, False, True]
    with pytest.raises(ValueError, match="drop --early-stop"):
        run_bench_spex(model, DraftOptions(draft="ngram"), replace(tree, early_stop=True), opts)
    assert result["remote"]["same_answers"] == result["remote"]["questions"] == 2
    assert (tmp_path / "results.png").stat().st_size > 0
    table = (tmp_path / "results.md").read_text()
    assert "| gsm8k | rebase | 2 | spex |" in table
    assert "k_total = 8 (fixed" in table and result["concurrency"] is None  # no throughput sweep when fixed
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    again = run_bench_spex(model, DraftOptions(draft="ngram"), tree, opts)  # everything from the records
    assert (tmp_path / "records.jsonl").read_text().splitlines() == lines
    assert json.loads(json.dumps(again["rows"])) == json.loads(json.dumps(result["rows"]))
