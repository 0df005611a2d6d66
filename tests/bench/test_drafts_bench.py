"""`bench drafts` end to end on a tiny checkpoint with untrained EDD and VDM folders: every draft row (the
prompt-lookup ones included) decodes each prompt to `ar`'s greedy tokens, the table and the calibration plot
are written, and a second run resumes everything from the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spectot.bench.drafts import run_bench_drafts
from spectot.config import BenchDraftsOptions, ModelOptions
from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint

DATA = Path(__file__).parents[3] / "shared" / "data"
GSM8K = DATA / "gsm8k" / "test.jsonl"
CREATIVE_WRITING = DATA / "tot_creative_writing" / "data_100_random_text.txt"


def save_draft(target, kind: str, folder: Path) -> str:
    config = DraftDecoderConfig(
        kind, 1, -2 if kind == "edd" else None, 64, fingerprint(target), target.config.to_dict()
    )
    DraftDecoder.initialise(config, target, torch.arange(64)).save(folder, torch.arange(64))
    return str(folder)


def bench_options(target, tmp_path: Path, **settings) -> BenchDraftsOptions:
    """This file's data, an untrained EDD of ``target``, and ``settings``."""
    return BenchDraftsOptions(
        **{
            "gsm8k": str(GSM8K),
            "creative_writing": str(CREATIVE_WRITING),
            "edd": save_draft(target, "edd", tmp_path / "edd"),
            "vdm": str(tmp_path / "no-such-vdm"),
            "out": str(tmp_path / "bench"),
            **settings,
        }
    )


@pytest.mark.skipif(not (GSM8K.exists() and CREATIVE_WRITING.exists()), reason="needs ../shared/data")
def test_bench_drafts_rows_keep_ar_tokens_and_resume(tiny_checkpoint, tiny_model, tmp_path) -> None:
    target = tiny_model("llama", 0)  # the checkpoint's weights
    vdm = save_draft(target, "vdm", tmp_path / "vdm")
    opts = bench_options(target, tmp_path, gsm8k_prompts=2, cw_prompts=1, max_new_tokens=12, k=3, vdm=vdm)
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    result = run_bench_drafts(model, opts)
    methods = ["ar", "ngram", "vdm", "edd", "edd+pct", "edd+lookup", "edd+pct+lookup"]
    assert [r["method"] for r in result["rows"] if r["prompts"] == "all"] == methods
    assert {r["prompts"] for r in result["rows"]} == {"all", "gsm8k", "creative_writing"}
    records = [json.loads(line) for line in (tmp_path / "bench" / "records.jsonl").read_text().splitlines()]
    tokens = {tuple(r["key"]): r["value"]["tokens"] for r in records if r["key"][0] != "cost"}
    for i in range(3):  # lossless: every draft decodes every prompt to ar's greedy tokens
        assert all(tokens[(name, i)] == tokens[("ar", i)] for name in methods)
    assert "| all | edd+pct+lookup |" in (tmp_path / "bench" / "results.md").read_text()
    for row in result["rows"]:  # a step's time split: ar drafts nothing, every drafted row drafts something
        ms = row["ms_per_step"]
        assert ms["verify"] > 0 and ms["other"] >= 0 and (ms["draft"] == 0) == (row["method"] == "ar")
    assert (tmp_path / "bench" / "calibration.png").stat().st_size > 0
    lines = (tmp_path / "bench" / "records.jsonl").read_text().splitlines()
    again = run_bench_drafts(model, opts)
    assert (tmp_path / "bench" / "records.jsonl").read_text().splitlines() == lines
    assert json.loads(json.dumps(again["rows"])) == json.loads(json.dumps(result["rows"]))


@pytest.mark.skipif(not (GSM8K.exists() and CREATIVE_WRITING.exists()), reason="needs ../shared/data")
def test_bench_drafts_runs_only_the_chosen_rows(tiny_checkpoint, tiny_model, tmp_path) -> None:
    target = tiny_model("llama", 0)
    # the VDM folder does not exist: its row is not chosen, so it is never loaded
    mine = "mine=" + save_draft(target, "edd", tmp_path / "mine")  # an --ablation row runs whatever --methods says
    opts = bench_options(target, tmp_path, gsm8k_prompts=1, cw_prompts=0, max_new_tokens=6, k=2, methods="edd")
    opts = BenchDraftsOptions(**{**opts.__dict__, "ablation": (mine,)})
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    result = run_bench_drafts(model, opts)
    assert [r["method"] for r in result["rows"] if r["prompts"] == "all"] == ["ar", "edd", "mine"]
    records = (tmp_path / "bench" / "records.jsonl").read_text()
    assert '"key": ["edd", 0]' in records and '"key": ["ar", 1]' not in records  # --cw-prompts 0: none
    with pytest.raises(ValueError, match="unknown rows \\['edd\\+tree'\\]"):
        run_bench_drafts(model, BenchDraftsOptions(**{**opts.__dict__, "methods": "edd,edd+tree"}))


def test_ablation_rows_take_draft_option_fields() -> None:
    from spectot.bench.drafts import _ablation_row

    plain = _ablation_row("runs/edd-nohidden", 5)
    assert (plain.draft, plain.num_draft_tokens, plain.lookup, plain.tree) == ("runs/edd-nohidden", 5, 0, "auto")
    row = _ablation_row("edd,tree=pct,num_draft_tokens=16,lookup=2,draft_head=2048,coupled=false", 5)
    assert (row.tree, row.num_draft_tokens, row.lookup, row.draft_head, row.coupled) == ("pct", 16, 2, 2048, False)
    for bad in ("edd,nonsense=1", "edd,draft=vdm", "edd,tree", "edd,draft_head=many"):
        with pytest.raises(ValueError):
            _ablation_row(bad, 5)
    with pytest.raises(ValueError, match="--draft-head"):
        _ablation_row("edd,draft_head=-2", 5)
