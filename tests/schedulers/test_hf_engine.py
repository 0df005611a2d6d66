"""``hf-batched-ar``, transformers' padded ``generate()`` on a level: under greedy decoding it returns
serial ``ar``'s streams (fp32 tiny target; prompts of different lengths, so left padding is exercised),
with the same temperature-1 log-probs, EOS and stop-string endings."""

from __future__ import annotations

import pytest
import torch

from spectot.engine.runner import ModelRunner
from spectot.schedulers.base import Level
from spectot.schedulers.hf import HFBatchedEngine
from spectot.schedulers.serial import SerialEngine
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.sampling import SamplingParams

PROMPTS = [list(range(3, 23)) + [5, 9], [11, 4, 4, 2], list(range(30, 40))]
CONTEXT = 2048


def detokenize(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.mark.parametrize("eos", [(), (7,)])
def test_greedy_hf_batch_equals_serial_ar(tiny_llama, eos) -> None:
    target = tiny_llama()
    level = Level(PROMPTS, DecodeConfig(max_new_tokens=16), [0, 1, 2])
    ar = SerialEngine(Decoder(ModelRunner(target), eos_token_ids=eos or (63,))).run(level)
    hf = HFBatchedEngine(target, eos or (63,), detokenize, CONTEXT).run(level)
    for a, h in zip(ar, hf):
        assert h.token_ids == a.token_ids
        assert h.finish_reason == a.finish_reason
        assert h.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert h.stats.new_tokens == len(h.token_ids) and h.stats.prompt_tokens == len(h.prompt_ids)
        assert h.stats.verify_steps == a.stats.verify_steps  # the prefill's token is no step (one more before)


def test_stop_strings_end_rows_where_spectot_does(tiny_llama) -> None:
    target = tiny_llama()
    free = SerialEngine(Decoder(ModelRunner(target), (63,), detokenize=detokenize))
    plain = free.run(Level(PROMPTS, DecodeConfig(max_new_tokens=16), [0, 1, 2]))
    stop = (f"w{plain[0].token_ids[3]}",)  # appears in the first stream's output
    level = Level(PROMPTS, DecodeConfig(max_new_tokens=16, stop=stop), [0, 1, 2])
    ar = free.run(level)
    hf = HFBatchedEngine(target, (63,), detokenize, CONTEXT).run(level)
    assert ar[0].finish_reason == "stop"
    assert [h.token_ids for h in hf] == [a.token_ids for a in ar]
    assert [h.finish_reason for h in hf] == [a.finish_reason for a in ar]


def test_sampling_is_reproducible_from_the_level_seed_and_leaves_global_rng_alone(tiny_llama) -> None:
    target = tiny_llama()
    engine = HFBatchedEngine(target, (63,), detokenize, CONTEXT)
    config = DecodeConfig(max_new_tokens=12, sampling=SamplingParams(do_sample=True, temperature=1.0))
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = engine.run(Level(PROMPTS, config, [5, 6, 7]))
    assert torch.rand(1) == before  # generate() drew from a forked generator
    again = engine.run(Level(PROMPTS, config, [5, 6, 7]))
    other = engine.run(Level(PROMPTS, config, [8, 6, 7]))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]


def test_the_checkpoints_generation_settings_do_not_leak_into_plain_decoding(tiny_llama) -> None:
    """generate() fills what the engine's config leaves unset from the checkpoint's generation_config: a shipped
    repetition_penalty or min_new_tokens (Qwen2.5-Instruct ships the first) made the baseline decode other text."""
    import copy

    target = copy.deepcopy(tiny_llama())  # the fixture's model is shared
    target.generation_config.repetition_penalty = 1.3
    target.generation_config.min_new_tokens = 16
    level = Level(PROMPTS, DecodeConfig(max_new_tokens=16), [0, 1, 2])
    ar = SerialEngine(Decoder(ModelRunner(target), eos_token_ids=(7,))).run(level)
    hf = HFBatchedEngine(target, (7,), detokenize, CONTEXT).run(level)
    assert [h.token_ids for h in hf] == [a.token_ids for a in ar]
    assert [h.finish_reason for h in hf] == [a.finish_reason for a in ar]
    assert target.generation_config.repetition_penalty == 1.3  # the checkpoint's own is given back


def test_a_prompt_past_the_context_is_refused_as_spectots_engines_refuse_it(tiny_llama) -> None:
    """generate() ran past the model's context (RoPE past its trained positions) where spectot's engines refuse."""
    from spectot.spec.decoding import PromptRefused

    engine = HFBatchedEngine(tiny_llama(), (63,), detokenize, max_context=30)
    with pytest.raises(PromptRefused, match="prompt 0 has 22 tokens; with max_new_tokens=16 it exceeds"):
        engine.run(Level(PROMPTS, DecodeConfig(max_new_tokens=16), [0, 1, 2]))
    assert len(engine.run(Level(PROMPTS, DecodeConfig(max_new_tokens=8), [0, 1, 2]))) == 3


def test_a_stop_string_opening_with_a_space_ends_a_sentencepiece_row_at_its_first_token(tiny_llama) -> None:
    """A SentencePiece tokenizer decodes a row's first token without its space: read after the prompt, " w39"
    ends the row there, in spectot's engine and in transformers' alike (both ran on to max_new_tokens)."""
    from conftest import build_metaspace_tokenizer

    tokenizer = build_metaspace_tokenizer()
    words = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    target = tiny_llama()
    serial = SerialEngine(Decoder(ModelRunner(target), (63,), detokenize=words))
    plain = serial.run(Level(PROMPTS, DecodeConfig(max_new_tokens=8), [0, 1, 2]))
    assert all(p.token_ids[0] > 3 for p in plain)  # words, not special tokens
    stop = tuple(" " + words(p.token_ids[:1]) for p in plain)
    level = Level(PROMPTS, DecodeConfig(max_new_tokens=8, stop=stop), [0, 1, 2])
    hf = HFBatchedEngine(target, (63,), words, CONTEXT)
    for engine in (serial, hf):
        results = engine.run(level)
        assert [r.token_ids for r in results] == [p.token_ids[:1] for p in plain]
        assert {r.finish_reason for r in results} == {"stop"}
    assert {r.stats.target_forwards for r in hf.run(level)} == {1}  # generate() stopped there, not cut after 8
