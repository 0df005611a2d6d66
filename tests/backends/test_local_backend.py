"""The local engine behind the async backend interface, on a tiny fp32 checkpoint.

- concurrent greedy completions equal the Pipeline's own greedy generate, text for text, with speculative
  (priority 1) prompts prefilled at once or in chunks beside the primary ones, drafted for or decoded
  autoregressively (``draft_priority=0``);
- logprobs are the target's log-probabilities of the emitted tokens;
- streamed pieces join to the completion's text and stop strings never leak into them;
- cancelling the awaiting task abandons the request and later requests still complete;
- a prompt's token count is the ids the model is fed, a BOS the tokenizer adds included.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from spectot.backends.base import Completion, CompletionRequest
from spectot.backends.local import LocalEngineBackend
from spectot.config import DraftOptions, ModelOptions
from spectot.pipeline import Pipeline

PROMPTS = ["w1 w2 w3 w1 w2", "w5 w6", "w7 w8 w9 w10", "w1 w2 w3 w1 w2"]


@pytest.fixture(scope="module")
def pipe(tiny_checkpoint) -> Pipeline:
    return Pipeline.from_options(
        ModelOptions(target=str(tiny_checkpoint), dtype="fp32", kernels="torch"), DraftOptions(draft="ngram")
    )


@pytest.mark.parametrize("method", ["ar", "sd"])
@pytest.mark.parametrize("fill_rows", [0, 2])  # speculative prompts prefilled at once, or 2 rows a step
@pytest.mark.parametrize("draft_priority", [None, 0])  # drafts for every request, or for primary ones only
def test_concurrent_greedy_completions_equal_pipeline(pipe, method, fill_rows, draft_priority) -> None:
    want = [g.text for g in pipe.generate(PROMPTS, max_new_tokens=12, method="ar")]

    async def main():
        backend = LocalEngineBackend.from_pipeline(
            pipe, method=method, fill_rows=fill_rows, draft_priority=draft_priority
        )
        assert (backend.engine.fill_rows, backend.engine.draft_priority) == (fill_rows, draft_priority)
        requests = [CompletionRequest(p, 12, chat=True, priority=i % 2) for i, p in enumerate(PROMPTS)]
        try:
            return await asyncio.gather(*(backend.complete(r) for r in requests))
        finally:
            await backend.aclose()

    got = asyncio.run(main())
    assert [c.text for c in got] == want
    assert all(c.completion_tokens == 12 or c.finish_reason == "stop" for c in got)


def test_logprobs_are_the_targets(pipe) -> None:
    async def main():
        backend = LocalEngineBackend.from_pipeline(pipe)
        try:
            return await backend.complete(CompletionRequest("w5 w6", 6, logprobs=True, chat=True))
        finally:
            await backend.aclose()

    out = asyncio.run(main())
    ids = pipe.encode("w5 w6")
    gen = pipe.generate("w5 w6", max_new_tokens=6, method="ar")[0].token_ids
    with torch.no_grad():
        logits = pipe.target.model(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1]
    want = logits.log_softmax(-1)[torch.arange(len(gen)), torch.tensor(gen)]
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4)
    assert out.mean_logprob == pytest.approx(float(want.mean()), abs=1e-4)


def test_stream_joins_to_the_completion_and_hides_stop_strings(pipe) -> None:
    full = pipe.generate("w7 w8 w9 w10", max_new_tokens=16, method="ar")[0].text
    words = full.split()
    stop = words[3] if len(words) > 4 else None

    async def main():
        backend = LocalEngineBackend.from_pipeline(pipe)
        try:
            request = CompletionRequest("w7 w8 w9 w10", 16, stop=(stop,) if stop else (), chat=True)
            *pieces, ending = [p async for p in backend.stream(request)]
            return pieces, ending, await backend.complete(request)
        finally:
            await backend.aclose()

    pieces, ending, completion = asyncio.run(main())
    assert all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == completion.text
    assert isinstance(ending, Completion)  # the stream ends with its Completion: same text, reason and counts
    assert (ending.text, ending.finish_reason) == (completion.text, completion.finish_reason)
    assert (ending.prompt_tokens, ending.completion_tokens) == (completion.prompt_tokens, completion.completion_tokens)
    if stop:
        assert stop not in "".join(pieces)
        assert completion.finish_reason == "stop"


def test_cancelled_task_abandons_its_request(pipe) -> None:
    async def main():
        backend = LocalEngineBackend.from_pipeline(pipe)
        try:
            task = asyncio.create_task(backend.complete(CompletionRequest("w1 w2", 400, chat=True)))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after = await backend.complete(CompletionRequest("w5 w6", 4, chat=True))
            return backend, after
        finally:
            await backend.aclose()

    backend, after = asyncio.run(main())
    assert after.completion_tokens <= 4
    assert backend.engine.counters.cancelled + backend.engine.counters.finished >= 1
    pipe.decoder.prefix_cache.clear()
    assert pipe.runner.cache.used == 0  # nothing held outside the prefix cache


def test_prompt_token_count_is_what_the_model_is_fed(tiny_checkpoint) -> None:
    """With a tokenizer that puts a BOS before text (Llama's, Mistral's), a completion prompt is fed with it, a
    rendered chat (which starts with its own) and a chat message through the template are not doubled."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    backend = LocalEngineBackend(engine=None, tokenizer=tokenizer)  # counting needs no engine
    for prompt, chat in [("w5 w6", False), ("<s> w5 w6", False), ("w5 w6", True)]:
        fed = backend.encode(CompletionRequest(prompt, chat=chat))
        assert backend.count_prompt_tokens(prompt, chat) == len(fed)
    assert backend.encode(CompletionRequest("w5 w6")) == [1, 9, 10]
    assert backend.count_tokens("w5 w6") == 2  # bare text, as a completion's is counted


def test_no_chat_template_renders_chats_as_text(tiny_checkpoint) -> None:
    """--no-chat-template reaches the engine backend: a chat request is fed as its text, as Pipeline.encode does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tokenizer.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    templated = LocalEngineBackend(engine=None, tokenizer=tokenizer)
    plain = LocalEngineBackend(engine=None, tokenizer=tokenizer, chat_template=False)
    request = CompletionRequest("w5 w6", chat=True)
    assert plain.encode(request) == list(tokenizer("w5 w6")["input_ids"])
    assert templated.encode(request) != plain.encode(request)
    assert plain.render_chat([{"role": "user", "content": "w5"}, {"role": "user", "content": "w6"}]) == "w5\nw6"
