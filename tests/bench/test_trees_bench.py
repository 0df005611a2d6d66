"""`bench trees` end to end on a tiny checkpoint with an untrained EDD: every tree method runs, the JSON,
Markdown and plot are written (the Markdown's title raised KeyError: 'draft', so no run ever finished), and
every greedy row decodes each prompt to ``ar``'s tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spectot.bench.trees import run_bench_trees
from spectot.config import BenchTreesOptions, DraftOptions, ModelOptions
from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint

DATA = Path(__file__).parents[3] / "shared" / "data"
GSM8K = DATA / "gsm8k" / "test.jsonl"


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data")
def test_bench_trees_runs_every_method_and_writes_its_tables(tiny_checkpoint, tiny_model, tmp_path) -> None:
    target = tiny_model("llama", 0)
    config = DraftDecoderConfig("edd", 1, -2, 64, fingerprint(target), target.config.to_dict())
    DraftDecoder.initialise(config, target, torch.arange(64)).save(tmp_path / "edd", torch.arange(64))
    out = tmp_path / "bench"
    opts = BenchTreesOptions(
        gsm8k=str(GSM8K), gsm8k_prompts=2, cw_prompts=0, measure_prompts=1, max_new_tokens=6, temperatures="0",
        tn_max=4, sequoia_max_nodes=8, sequoia_max_depth=3, sequoia_fixed=6, eagle2_tokens=4, out=str(out),
    )  # fmt: skip
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    result = run_bench_trees(model, DraftOptions(draft=str(tmp_path / "edd")), opts)
    rows = [r for r in result["rows"] if r["prompts"] == "all"]
    assert rows[0]["method"] == "ar" and len(rows) > 3
    assert all(r["same_tokens_as_ar"] == r["prompts_compared"] == 2 for r in rows)  # lossless, every tree
    assert f"draft {tmp_path / 'edd'}" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["rows"]
    assert (out / "results.png").stat().st_size > 0
