"""The local engine behind the async backend interface, on a tiny fp32 checkpoint.

- concurrent greedy completions equal the Pipeline's own greedy generate, text for text, with speculative
  (priority 1) prompts prefilled at once or in chunks beside the primary ones, drafted for or decoded
  autoregressively (``draft_priority=0``);
- logprobs are the target's log-probabilities of the emitted tokens;
- streamed pieces join to the completion's text and stop strings never leak into them;
- cancelling the awaiting task abandons the request and later requests still complete;
- a prompt's token count is the ids the model is fed, a BOS the tokenizer adds included;
- a long stream decodes only a window of new tokens a step and still joins, byte for byte, to the completion
  (multi-byte characters, stop strings), on a scripted engine with a byte-level tokenizer;
- a failed engine step is the backend's ``failure()``.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from spectot.backends.base import Completion, CompletionRequest
from spectot.backends.local import LocalEngineBackend, decode_increment, token_pieces
from spectot.config import DraftOptions, ModelOptions
from spectot.pipeline import Pipeline
from spectot.spec.decoding import StreamResult
from spectot.spec.stats import DecodeStats

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
    assert len(out.tokens) == len(gen) and "".join(out.tokens) == pipe.generate("w5 w6", max_new_tokens=6)[0].text


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


def test_a_stream_cancelled_while_it_waits_leaves_no_task_behind(pipe) -> None:
    """The consumer cancelled while the stream waited for its next tokens: the queue getter it waited on was left
    pending forever (one per cancelled stream, "Task was destroyed but it is pending" at shutdown)."""

    async def main():
        backend = LocalEngineBackend.from_pipeline(pipe)
        submit = backend._submit

        def first_piece_only(request, prompt, listener=None):  # then the stream waits, as behind a long engine step
            return submit(request, prompt, lambda ids, seen=[]: None if seen else (seen.append(1), listener(ids)))

        backend._submit = first_piece_only
        try:

            async def consume() -> None:
                async for _ in backend.stream(CompletionRequest("w1 w2", 400, chat=True)):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # at once, before another piece of the abandoned request could land and complete a forgotten getter
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.cancelling()]
            for _ in range(3):  # the cancellations settle
                await asyncio.sleep(0)
            return left, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        finally:
            await backend.aclose()

    assert asyncio.run(main()) == ([], [])


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


# -- streaming: incremental decoding ------------------------------------------------------------------------------
def byte_tokenizer():
    """Byte-level BPE without merges: a token per byte, so "é" is two tokens and "🙂" four."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


class ScriptedEngine:
    """Stands in for ``ContinuousEngine``: every request generates ``ids`` (up to the first stop string, as the engine
    ends a stream), told to the listener from a thread a few tokens a step."""

    _failure = None

    def __init__(self, text: str, ids: list[int], steps: list[int]) -> None:
        self.text, self.ids, self.steps = text, ids, steps

    def submit(self, prompt, config, seed, listener=None, priority=0) -> Future:
        ids, finish = self.ids, "length"
        cuts = [self.text.find(s) + len(s) for s in config.stop if s in self.text]
        if cuts:  # one token a byte: the stream ends with the token that completes the stop string
            ids, finish = ids[: len(self.text[: min(cuts)].encode())], "stop"
        future: Future = Future()

        def run() -> None:
            sent = 0
            for step in self.steps:
                if sent >= len(ids):
                    break
                if listener is not None:
                    listener(ids[sent : sent + step])
                sent += step
                time.sleep(0.0002)
            future.set_result(StreamResult(list(prompt), ids, finish, DecodeStats()))

        threading.Thread(target=run, daemon=True).start()
        return future

    def close(self) -> None:
        pass


TEXT = "Ünïcode wörds, 🙂 emoji and 中文 text; " * 60 + "the end: 中文 🙂"  # 2,173 characters in 2,780 byte tokens


@pytest.mark.parametrize("stop", [(), ("end: 中文 🙂",), ("zzz", "中文 🙂", "d: 中"), ("s, 🙂",)])
def test_a_long_stream_decodes_incrementally_and_joins_to_the_completion(stop) -> None:
    """Every step decoded the whole text so far (24 streams of 1,800 tokens: 24 s streamed against 6.9 s not);
    now a window of the newest tokens, and the pieces still join to the non-streamed text, byte for byte, with
    multi-byte characters split across steps and stop strings held back."""
    tokenizer = byte_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT.encode()) == 2780
    rng = random.Random(0)
    engine = ScriptedEngine(TEXT, ids, [rng.randint(1, 5) for _ in range(len(ids))])
    backend = LocalEngineBackend(engine, tokenizer, max_context=8192)
    decoded: list[int] = []
    decode = tokenizer.decode

    def counting_decode(token_ids, **kwargs):
        decoded.append(len(token_ids))
        return decode(token_ids, **kwargs)

    tokenizer.decode = counting_decode
    request = CompletionRequest("p", len(ids), stop=stop)

    async def main():
        *pieces, ending = [p async for p in backend.stream(request)]
        return pieces, ending, await backend.complete(request)

    pieces, ending, completion = asyncio.run(main())
    assert "".join(pieces) == ending.text == completion.text
    assert completion.text == (TEXT[: min(TEXT.find(s) for s in stop if s in TEXT)] if stop else TEXT)
    assert all("\ufffd" not in p for p in pieces)
    if len(completion.text) > 1000:
        assert len(pieces) > 100  # streamed as generated, not all at the end
    assert sorted(decoded)[-3] <= 64  # besides the two whole decodes (the stream's Completion, complete's), windows


def test_decode_increment_worked_example() -> None:
    tokenizer = byte_tokenizer()
    a, c3, a9 = tokenizer("aé", add_special_tokens=False)["input_ids"]
    decode = tokenizer.decode
    assert decode_increment(decode, [a], 0, 0) == ("a", 0, 1)
    assert decode_increment(decode, [a, c3], 0, 1) == ("", 0, 1)  # half a character: held
    assert decode_increment(decode, [a, c3, a9], 0, 1) == ("é", 1, 3)


def test_token_pieces_join_to_the_text() -> None:
    tokenizer = byte_tokenizer()
    a, c3, a9 = tokenizer("aé", add_special_tokens=False)["input_ids"]
    decode = tokenizer.decode
    assert token_pieces(decode, [a, c3, a9]) == ["a", "", "é"]
    assert token_pieces(decode, [a, c3]) == ["a", "\ufffd"]  # cut off mid-character: the last piece holds it
    assert token_pieces(decode, []) == []


def test_server_ids_and_top_k_reach_the_engine(tiny_checkpoint) -> None:
    """``prompt_ids`` (the server tokenised the prompt once) are fed as they are; ``top_k`` reaches the sampler."""
    from transformers import AutoTokenizer

    backend = LocalEngineBackend(engine=None, tokenizer=AutoTokenizer.from_pretrained(tiny_checkpoint))
    assert backend.encode(CompletionRequest("w5 w6", prompt_ids=(7, 8, 9))) == [7, 8, 9]
    config = backend._config(CompletionRequest("w5 w6", temperature=0.7, top_k=3))
    assert (config.sampling.top_k, config.sampling.temperature, config.sampling.do_sample) == (3, 0.7, True)


def test_failure_names_the_step_that_stopped_the_engine(pipe, monkeypatch) -> None:
    from spectot.spec.decoding import DecodeSession

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    async def main():
        backend = LocalEngineBackend.from_pipeline(pipe)
        try:
            assert backend.failure() is None
            monkeypatch.setattr(DecodeSession, "verify", out_of_memory)
            with pytest.raises(RuntimeError, match="injected"):
                await backend.complete(CompletionRequest("w5 w6", 4))
            return backend.failure()
        finally:
            monkeypatch.undo()
            await backend.aclose()

    assert "out of memory (injected)" in asyncio.run(main())


def test_a_live_priority_ranks_the_request_from_its_submission_and_follows_it(tiny_checkpoint) -> None:
    """The engine got ``request.priority`` even where the live value said otherwise (it kept the stale rank
    until the next change); each change reaches ``reprioritize`` until the request resolves."""
    from concurrent.futures import Future

    from transformers import AutoTokenizer

    from spectot.backends.base import LivePriority

    class Engine:  # what the backend tells the engine, recorded
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []
            self.future: Future = Future()

        def submit(self, prompt, config, seed, listener=None, priority=0) -> Future:
            self.calls.append(("submit", priority))
            return self.future

        def reprioritize(self, future, priority) -> None:
            self.calls.append(("reprioritize", priority))

    engine = Engine()
    backend = LocalEngineBackend(engine=engine, tokenizer=AutoTokenizer.from_pretrained(tiny_checkpoint))
    live = LivePriority(2)
    live.set(0)  # taken over before it was submitted
    backend._submit(CompletionRequest("w5 w6", priority=2, live_priority=live), [9, 10])
    live.set(1)
    engine.future.set_result(None)
    live.set(2)  # resolved: nobody is told
    assert engine.calls == [("submit", 0), ("reprioritize", 1)]


def test_a_sentencepiece_completion_keeps_its_leading_space(metaspace_checkpoint) -> None:
    """A completion, its streamed pieces and its per-token pieces read after the prompt: with a SentencePiece
    tokenizer (Llama-2's, Mistral's) " Paris." came back "Paris.", and a stop string opening with a space never
    matched on the first token."""
    pipe = Pipeline.from_options(
        ModelOptions(target=str(metaspace_checkpoint), dtype="fp32", kernels="torch"), DraftOptions(draft="ngram")
    )
    [g] = pipe.generate(["w5 w6"], max_new_tokens=6)
    first = pipe.target.tokenizer.decode(g.token_ids[:1])

    async def main():
        backend = LocalEngineBackend.from_pipeline(pipe)
        try:
            request = CompletionRequest("w5 w6", 6, logprobs=True)
            *pieces, streamed = [p async for p in backend.stream(request)]
            whole = await backend.complete(request)
            cut = await backend.complete(CompletionRequest("w5 w6", 6, stop=(" " + first,)))
            return pieces, streamed, whole, cut
        finally:
            await backend.aclose()

    pieces, streamed, whole, cut = asyncio.run(main())
    assert g.text.startswith(" ")
    assert "".join(pieces) == streamed.text == whole.text == g.text
    assert whole.tokens[0] == " " + first and "".join(whole.tokens) == g.text
    assert (cut.text, cut.finish_reason, cut.completion_tokens) == ("", "stop", 1)
