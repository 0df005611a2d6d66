"""`pipeline.make_engine`: each engine of `spectot solve` gets the draft set-up its flags ask for."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spectot.config import DraftOptions, ModelOptions
from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint
from spectot.pipeline import Pipeline, make_engine
from spectot.spec.trees.dynamic import PCTPolicy


def test_a_pct_engine_verifies_only_the_tree_size_this_machine_pays_for(tiny_checkpoint, tiny_model, tmp_path):
    """`solve --engine sd --tree pct`: the engine's PCT policy gets t(n), as `Pipeline.from_options` gives it."""
    target = tiny_model("llama", 0)  # the checkpoint's weights
    config = DraftDecoderConfig("edd", 1, -2, 64, fingerprint(target), target.config.to_dict())
    DraftDecoder.initialise(config, target, torch.arange(64)).save(tmp_path / "edd", torch.arange(64))
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    costs = {"t_curve": [{"n": 1, "t": 1.0}, {"n": 8, "t": 1.2}, {"n": 64, "t": 4.0}], "draft_cost": 0.1}
    draft = DraftOptions(draft=str(tmp_path / "edd"), tree="pct", adaptive_k=False)
    engine, method = make_engine(pipe, "sd", draft, model, costs)
    policy = engine.decoder.proposer.policy
    assert method == "sd" and isinstance(policy, PCTPolicy)
    assert policy.verify_cost is not None and policy.verify_cost(8) == 1.2
    chain, _ = make_engine(pipe, "sd", DraftOptions(draft=str(tmp_path / "edd"), adaptive_k=False), model, costs)
    assert not isinstance(chain.decoder.proposer.policy, PCTPolicy)  # --tree auto: sd drafts chains


def test_auto_draft_head_cuts_only_a_ranked_head_on_the_cpu(tiny_checkpoint, tiny_model, tmp_path, monkeypatch):
    """--draft-head -1 (auto): the ranked head's first CPU_DRAFT_HEAD tokens on a CPU, an unranked head whole;
    an explicit size always wins (and an unranked head refuses to be cut)."""
    import pytest

    import spectot.pipeline as pipeline

    target = tiny_model("llama", 0)
    head = torch.arange(64).flip(0)  # a ranked head is stored most frequent first, in any id order
    for name, ranked in (("ranked", True), ("unranked", False)):
        config = DraftDecoderConfig("edd", 1, -2, 64, fingerprint(target), target.config.to_dict(), head_ranked=ranked)
        DraftDecoder.initialise(config, target, head).save(tmp_path / name, head)
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    monkeypatch.setattr(pipeline, "CPU_DRAFT_HEAD", 16)  # the tiny head has 64 tokens

    def head_of(name: str, size: int) -> torch.Tensor:
        options = DraftOptions(draft=str(tmp_path / name), draft_head=size)
        return pipeline.make_proposer(options, pipe.target, model).draft.head_ids

    assert head_of("ranked", -1).equal(head[:16])
    assert head_of("unranked", -1).equal(head)
    assert head_of("ranked", 0).equal(head) and head_of("ranked", 8).equal(head[:8])
    with pytest.raises(ValueError, match="not ranked"):
        head_of("unranked", 8)


def test_a_short_context_target_loads_with_the_adaptive_draft_length(tiny_checkpoint, tiny_model, tmp_path) -> None:
    """The load-time cost probe (t(n), c) prefilled 256 tokens and ran 64 rows: a target with a 40-token context
    could not load with the default n-gram draft. It now measures within the context."""
    from transformers import AutoTokenizer

    tiny_model("llama", 0, max_position_embeddings=40).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(tmp_path)
    model = ModelOptions(target=str(tmp_path), dtype="fp32", kernels="torch", chat_template=False)
    pipe = Pipeline.from_options(model, DraftOptions(draft="ngram"))
    ar = pipe.generate("w1 w2 w3 w1 w2", max_new_tokens=20, method="ar")[0]
    sd = pipe.generate("w1 w2 w3 w1 w2", max_new_tokens=20, method="sd")[0]
    assert sd.token_ids == ar.token_ids


def test_each_prompt_draws_its_own_samples_whatever_the_batching(tiny_checkpoint) -> None:
    """Prompt i is seeded by (seed, its index): batch 1 gave every prompt the same seed (six copies of a prompt
    sampled one text; 40 prompts one first token), and a resumed run drew other samples than an unbroken one."""
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    prompts = ["w1 w2 w3"] * 6 + [f"w{i} w{i + 1}" for i in range(4, 10)]
    sample = dict(max_new_tokens=6, do_sample=True, temperature=1.0, method="ar", seed=3)
    one = [g.token_ids for g in pipe.generate(prompts, batch_size=1, **sample)]
    four = [g.token_ids for g in pipe.generate(prompts, batch_size=4, **sample)]
    resumed = [g.token_ids for g in pipe.generate(prompts[5:], batch_size=2, first_index=5, **sample)]
    assert one == four and one[5:] == resumed
    assert len({tuple(t) for t in one[:6]}) > 1  # copies of one prompt are independent draws


def test_which_drafts_sample_their_tokens(tiny_checkpoint, tiny_model, tmp_path) -> None:
    """A sampling draft keeps the distribution but not a request's very samples (SPEX warns of it)."""
    from spectot.pipeline import make_proposer, samples_its_drafts

    target = tiny_model("llama", 0)
    config = DraftDecoderConfig("edd", 1, -2, 64, fingerprint(target), target.config.to_dict())
    DraftDecoder.initialise(config, target, torch.arange(64)).save(tmp_path / "edd", torch.arange(64))
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    edd = str(tmp_path / "edd")
    assert not samples_its_drafts(None)
    assert not samples_its_drafts(make_proposer(DraftOptions(draft="ngram"), pipe.target, model))
    assert not samples_its_drafts(make_proposer(DraftOptions(draft=edd), pipe.target, model))  # top children
    sampled = DraftOptions(draft=edd, tree="k_config", k_config="2,1")  # auto: drawn without replacement
    assert samples_its_drafts(make_proposer(sampled, pipe.target, model))


def test_the_python_api_refuses_what_it_would_run_as_something_else(tiny_checkpoint) -> None:
    """method 'mcsd' (or 'SD') ran as plain ar; batch_size 0 raised range()'s error and -1 returned nothing; an
    unknown engine name was reported as needing a draft, or after the draft had loaded."""
    import pytest

    from spectot.spec.decoding import DecodeConfig

    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch", chat_template=False)
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    with pytest.raises(ValueError, match="method must be one of"):
        DecodeConfig(method="mcsd")
    for size in (0, -1):
        with pytest.raises(ValueError, match="batch_size must be >= 1"):
            pipe.generate(["w1"], method="ar", batch_size=size)
    with pytest.raises(ValueError, match="unknown engine 'seeed'"):
        make_engine(pipe, "seeed", DraftOptions(draft="none"), model)
    with pytest.raises(ValueError, match="--engine mcsd verifies k_config trees"):  # it ran chain SD as 'mcsd'
        make_engine(pipe, "mcsd", DraftOptions(draft="ngram"), model)
    # one stop string given bare is one stop string (it stopped at each of its characters)
    bare, wrapped = (pipe.generate(["w1 w2"], max_new_tokens=8, method="ar", stop=s)[0] for s in ("w9 w9", ("w9 w9",)))
    assert bare.text == wrapped.text
    # the defaults work together: a pipeline without a draft decodes plainly (it raised, method 'sd' needing a
    # draft), and stop=None is no stop string (a TypeError)
    plain = pipe.generate("w1 w2", max_new_tokens=4, stop=None)[0]
    assert plain.text == pipe.generate("w1 w2", max_new_tokens=4, method="ar")[0].text


def test_a_trained_draft_folder_named_with_a_tilde_is_found(tmp_path, monkeypatch) -> None:
    """is_draft_decoder expanded '~', draft_decoder_folder did not: --draft=~/edd passed every check, then the
    folder was loaded as a model ('has no config.json')."""
    from spectot.pipeline import draft_decoder_folder

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "edd").mkdir()
    (tmp_path / "edd" / "draft.json").write_text("{}")
    assert draft_decoder_folder("~/edd", "smollm2-135m") == tmp_path / "edd"


def test_a_builtin_name_that_is_also_a_folder_here_is_refused(tmp_path, monkeypatch) -> None:
    """`train-draft --out edd` then `--draft edd` ran the shipped draft, and a fine-tuned ./smollm2-135m was
    ignored for the alias, both in silence."""
    from spectot.models.loader import ModelLoadError, resolve_checkpoint
    from spectot.pipeline import draft_decoder_folder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "edd").mkdir()
    (tmp_path / "edd" / "draft.json").write_text("{}")
    with pytest.raises(ValueError, match=r"names both the shipped edd draft and a draft folder here: pass ./edd"):
        draft_decoder_folder("edd", "smollm2-135m")
    assert draft_decoder_folder("./edd", "smollm2-135m") == Path("./edd")
    (tmp_path / "smollm2-135m").mkdir()
    with pytest.raises(ModelLoadError, match=r"names both a built-in model and a path here: pass ./smollm2-135m"):
        resolve_checkpoint("smollm2-135m")


def test_the_load_shortcut_takes_the_device_and_the_prefix_cache(tiny_checkpoint) -> None:
    """Pipeline.load took neither: on a GPU machine it always ran on CUDA, with the default prefix cache."""
    pipe = Pipeline.load(str(tiny_checkpoint), dtype="fp32", kernels="torch", device="cpu", prefix_cache=0)
    assert pipe.target.model.device.type == "cpu" and pipe.decoder.prefix_cache.max_tokens == 0


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_a_sentencepiece_completion_keeps_its_leading_space(metaspace_checkpoint, method) -> None:
    """With a SentencePiece (Metaspace) tokenizer, as Llama-2's and Mistral's, a completion decoded alone lost its
    leading space: the prompt and its completion joined read "w5 w6w39 w14" (an unknown word for the next
    search level). Read after the prompt, they join to the text of the ids generated, in ``Pipeline.generate``
    and in the search's backend alike, and a stop string opening with a space ends the text at its first token."""
    from spectot.search.policy import GenerationCall, LocalBackend
    from spectot.tasks.base import StepRequest

    pipe = Pipeline.from_options(
        ModelOptions(target=str(metaspace_checkpoint), dtype="fp32", kernels="torch"), DraftOptions(draft="ngram")
    )
    tokenizer = pipe.target.tokenizer
    [g] = pipe.generate(["w5 w6"], max_new_tokens=6, method=method)
    assert 3 not in g.token_ids  # no EOS: all words
    assert g.text.startswith(" ") and tokenizer("w5 w6" + g.text)["input_ids"] == g.prompt_ids + g.token_ids
    first = tokenizer.decode(g.token_ids[:1])  # "w39"
    [cut] = pipe.generate(["w5 w6"], max_new_tokens=6, method=method, stop=" " + first)
    assert (cut.token_ids, cut.finish_reason, cut.text) == (g.token_ids[:1], "stop", "")

    engine, method = make_engine(pipe, "ar" if method == "ar" else "sd", DraftOptions(draft="ngram"), ModelOptions())
    backend = LocalBackend(pipe.encode, pipe.decoder.detokenize, engine, method, 4)
    calls = [StepRequest("w5 w6", (), 6), StepRequest("w5 w6", (" " + first,), 6)]
    assert backend.generate(GenerationCall(calls, 0.0, [0, 1], "TG")) == [g.text, ""]


def test_trees_sized_per_stream_stay_within_a_steps_draft_depth(tiny_checkpoint, tiny_model, tmp_path) -> None:
    """continuous-sd / seed-batched / batched-sd size a Sequoia tree per stream up to 8 deep (root included); a
    step drafts at most k deep, so the planned tree was cut (8 of 32 nodes for a reviewer's case) where the DP's
    choice within k would have paid more."""
    from spectot.spec.sampling import SamplingParams

    target = tiny_model("llama", 0)
    config = DraftDecoderConfig("edd", 1, -2, 64, fingerprint(target), target.config.to_dict())
    DraftDecoder.initialise(config, target, torch.arange(64)).save(tmp_path / "edd", torch.arange(64))
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    free = {"t_curve": [{"n": 1, "t": 1.0}, {"n": 64, "t": 1.0}], "c": 0.0}  # wide trees cost nothing here
    for k in (3, 5, 9):
        draft = DraftOptions(draft=str(tmp_path / "edd"), acceptance="0.9,0.05,0.02", num_draft_tokens=k)
        engine, _ = make_engine(pipe, "batched-sd", draft, model, free)
        tree = engine.budget(1, SamplingParams()).shape
        depth = [0] * len(tree)
        for node, parent in enumerate(tree[1:], start=1):
            depth[node] = depth[parent] + 1
        assert max(depth) == min(k, 7)  # 8 deep with the root at most, as before


def test_an_engines_own_tree_and_the_python_api_follow_the_draft_options_k(tiny_checkpoint, tiny_model, tmp_path):
    """mcsd / seed draw the default k_config tree (2,2,1, 3 deep): with --num-draft-tokens 2 it was refused (by a
    flag nobody passed) once the model had loaded; now it is cut to k. ``Pipeline.generate`` drafted k = 5 whatever
    k the pipeline's tree was checked and planned against."""
    target = tiny_model("llama", 0)
    config = DraftDecoderConfig("edd", 1, -2, 64, fingerprint(target), target.config.to_dict())
    DraftDecoder.initialise(config, target, torch.arange(64)).save(tmp_path / "edd", torch.arange(64))
    model = ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch")
    pipe = Pipeline.from_options(model, DraftOptions(draft="none"))
    costs = {"t_curve": [{"n": 1, "t": 1.0}, {"n": 64, "t": 2.0}], "c": 0.0}
    draft = DraftOptions(draft=str(tmp_path / "edd"), num_draft_tokens=2, adaptive_k=False)
    engine, _ = make_engine(pipe, "mcsd", draft, model, costs)
    assert list(engine.decoder.proposer.policy.shape) == [-1, 0, 0, 1, 1, 2, 2]  # 2,2 of 2,2,1
    specinfer = DraftOptions(draft=str(tmp_path / "edd"), tree="specinfer", specinfer="2x8", num_draft_tokens=8)
    deep = Pipeline.from_options(model, replace(specinfer, adaptive_k=False))
    asked: list[int] = []
    generate = deep.decoder.generate
    deep.decoder.generate = lambda prompts, config, seeds: (
        asked.append(config.num_draft_tokens) or generate(prompts, config, seeds)
    )
    deep.generate("w5 w6", max_new_tokens=4)
    assert deep.num_draft_tokens == 8 and asked == [8]
    from spectot.backends.local import LocalEngineBackend

    backend = LocalEngineBackend.from_pipeline(deep, method="sd")  # the server's and the searches' backend too
    try:
        assert backend.num_draft_tokens == 8
    finally:
        backend.engine.close()
