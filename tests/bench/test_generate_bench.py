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
