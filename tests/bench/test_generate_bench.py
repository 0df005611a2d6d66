"""`bench generate`'s summary: a run with no verify step (one new token, or EOS at once) is summarised."""

from __future__ import annotations

from spectot.bench.generate import METHODS, _summarize


def test_a_run_without_verify_steps_is_summarised() -> None:
    """With --max-new-tokens 1 every sd step is the prefill's token: the summary divided by zero verify steps after
    every measurement was saved, and every rerun crashed the same way."""
    stats = {"verify_steps": 0, "mean_acceptance_length": 0.0, "proposed": 0, "accepted": 0, "target_forwards": 1}
    records = {
        (m, 0): {"prompt": 0, "seconds": 0.5, "tokens": [7], "stats": stats if "spectot" in m else {}} for m in METHODS
    }
    summary = _summarize(records, 1)
    assert summary["spectot_sd_ngram"]["mean_acceptance_length"] == 1.0
    assert summary["spectot_sd_ngram"]["acceptance_rate"] == 0.0
    assert all(row["speedup_vs_spectot_ar"] == 1.0 for row in summary.values())


def test_spectot_methods_empty_their_prefix_cache_outside_the_timed_region(tiny_checkpoint, tmp_path, monkeypatch):
    """Every method prefills its prompt, so spectot's prefix cache is emptied before each run; it was emptied
    inside the timed region, a cost HF's generate() never paid. A clear made to take 0.5 s shows where it runs."""
    import json
    import time

    from spectot.bench.generate import run_bench_generate
    from spectot.config import BenchGenerateOptions, ModelOptions
    from spectot.engine.prefix_cache import PrefixCache

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": q}) + "\n" for q in ["w5 w6 w7", "w1 w2 w3 w1 w2"]))
    clear = PrefixCache.clear
    cleared: list[int] = []

    def slow_clear(self) -> None:
        cleared.append(1)
        time.sleep(0.5)
        clear(self)

    monkeypatch.setattr(PrefixCache, "clear", slow_clear)
    options = BenchGenerateOptions(str(data), num_prompts=2, max_new_tokens=6, out=str(tmp_path / "out"), tn_max=2)
    result = run_bench_generate(ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch"), options)
    lines = (tmp_path / "out" / "records.jsonl").read_text().splitlines()
    timed = [v for v in (json.loads(line)["value"] for line in lines) if v["method"].startswith("spectot")]
    assert len(cleared) >= 4 and len(timed) == 4
    assert all(r["seconds"] < 0.5 for r in timed)
    assert set(result["methods"]) == set(METHODS)
