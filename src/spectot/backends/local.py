"""The steerable backend: spectot's continuous engine on a local target, behind ``AsyncBackend``.

Requests from any number of coroutines (a search's producers, a server's clients) are submitted to
one ``ContinuousEngine``, which batches every live request into shared target forwards and runs
token-level speculative decoding inside each (``method="sd"`` with the pipeline's draft). Cancelling
the awaiting task abandons the request: the engine frees its KV at its next step. A failed engine step stops the
engine for good: ``failure()`` says so from then on.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future

from spectot.backends.base import Completion, CompletionRequest
from spectot.models.loader import chat_ids
from spectot.schedulers.continuous import ContinuousEngine
from spectot.spec.decoding import CONTEXT_TOKENS, DecodeConfig, Method, StreamResult, cut_at_stop, decode_after
from spectot.spec.sampling import SamplingParams


class LocalEngineBackend:
    def __init__(
        self,
        engine: ContinuousEngine,
        tokenizer,  # a transformers tokenizer: encodes prompts, renders chats, decodes output
        method: Method = "ar",
        num_draft_tokens: int = 5,
        name: str = "local",
        max_context: int = 2048,
        chat_template: bool = True,  # False (--no-chat-template): chats are rendered as text, one message a line
    ) -> None:
        self.engine, self.tokenizer, self.method = engine, tokenizer, method
        self.num_draft_tokens, self.name, self.max_context = num_draft_tokens, name, max_context
        self.chat_template = chat_template and tokenizer.chat_template is not None

    @classmethod
    def from_pipeline(
        cls,
        pipe,
        method: Method = "ar",
        max_streams: int = 64,
        name: str | None = None,
        budget=None,
        fill_rows: int = 0,  # TreeSearchOptions' (--fill-rows) default: prefilled at once was faster here
        draft_priority: int | None = None,
        num_draft_tokens: int | None = None,  # None: the pipeline's (its DraftOptions')
    ):
        """Over a ``Pipeline``'s target (and its draft, for ``method="sd"``); ``fill_rows``: see ``ContinuousEngine``;
        ``draft_priority``: draft only for requests of this priority value or lower, at each step (0: primary ones,
        a speculative request the search takes over included; with a deterministic draft the output is the same
        either way, so this only decides where the forward's rows go; a sampling draft keeps the distribution)."""
        if method == "sd" and pipe.proposer is None:
            raise ValueError("method 'sd' needs a draft: load the pipeline with a draft (e.g. draft='ngram')")
        engine = ContinuousEngine(
            pipe.decoder, max_streams=max_streams, budget=budget, fill_rows=fill_rows, draft_priority=draft_priority
        )
        alias = name or pipe.target.name
        return cls(
            engine,
            pipe.target.tokenizer,
            method,
            pipe.num_draft_tokens if num_draft_tokens is None else num_draft_tokens,
            name=alias,
            max_context=pipe.runner.max_context,
            chat_template=pipe.chat_template,
        )

    # -- AsyncBackend ------------------------------------------------------------------------------
    async def complete(self, request: CompletionRequest) -> Completion:
        t = time.perf_counter()
        future = self._submit(request, self.encode(request))
        result = await asyncio.wrap_future(future)  # cancelling this task cancels the engine's request
        return self._completion(request, result, time.perf_counter() - t)

    async def stream(self, request: CompletionRequest) -> AsyncIterator[str | Completion]:
        """Text pieces as tokens are verified, then the ``Completion``; a piece that could still turn into a
        stop string, or ends inside a multi-byte character, is held back until it cannot.

        Each step decodes only a window of the newest tokens (``decode_increment``) and looks for stop strings
        only where the new text could complete one, so a stream costs O(tokens), not O(tokens^2); the pieces
        join to the ``Completion``'s text (decoded once, whole, as ``complete`` does). The window starts in the
        prompt's last tokens, as ``decode_after`` does for the whole text."""
        t = time.perf_counter()
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[list[int]] = asyncio.Queue()
        prompt = self.encode(request)
        future = self._submit(request, prompt, lambda ids: loop.call_soon_threadsafe(pieces.put_nowait, ids))
        done = asyncio.wrap_future(future)
        generated = prompt[-CONTEXT_TOKENS:]  # the prompt's tail, then the generated tokens
        prefix_offset, read_offset = 0, len(generated)  # decode_increment's window over ``generated``
        text = ""  # the text of generated[len(prompt tail) : read_offset]
        sent = 0  # characters of ``text`` yielded
        longest_stop = max((len(s) for s in request.stop), default=1)
        stopped = False  # ``text`` holds a stop string: the rest comes with the Completion, cut before it
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = asyncio.ensure_future(pieces.get())
                await asyncio.wait([getter, done], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                generated += getter.result()
                while not pieces.empty():
                    generated += pieces.get_nowait()
                if stopped:
                    continue
                new, prefix_offset, read_offset = decode_increment(self._decode, generated, prefix_offset, read_offset)
                if not new:
                    continue
                # A stop string first found now ends in the new text: search the new text and what precedes it.
                tail = text[max(0, len(text) - longest_stop + 1) :] + new
                text += new
                if _has_stop(tail, request.stop):
                    stopped = True
                    continue
                safe = len(text) - (longest_stop - 1)  # the held characters could begin a stop string
                if safe > sent:
                    yield text[sent:safe]
                    sent = safe
            result = await done
            while not pieces.empty():  # tokens of the last step may land after the future resolved
                pieces.get_nowait()
            completion = self._completion(request, result, time.perf_counter() - t)
            if len(completion.text) > sent:
                yield completion.text[sent:]
            yield completion
        finally:
            if not done.done():
                done.cancel()
            if getter is not None and not getter.done():  # the consumer was cancelled while it waited
                getter.cancel()

    def failure(self) -> str | None:
        """Why no request can run any more: the engine's worker stopped after a failed step (a CUDA error, out of
        memory); None while it runs."""
        error = self.engine.failure
        return None if error is None else f"the engine stopped after a failed step: {error!r}"

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.close)

    def _submit(self, request: CompletionRequest, prompt: list[int], listener=None) -> Future:
        """The request (``prompt`` its ids) in the engine; its live priority, if any, re-ranks it there until it
        resolves."""
        future = self.engine.submit(
            prompt,
            self._config(request),
            self._seed(request),
            listener=listener,
            priority=request.priority if request.live_priority is None else request.live_priority.value,
        )
        if request.live_priority is not None:
            unwatch = request.live_priority.watch(lambda value: self.engine.reprioritize(future, value))
            future.add_done_callback(lambda _: unwatch())
        return future

    # -- text <-> tokens ---------------------------------------------------------------------------
    def encode(self, request: CompletionRequest) -> list[int]:
        if request.prompt_ids is not None:  # tokenised by the caller with ``prompt_ids``
            return list(request.prompt_ids)
        return self.prompt_ids(request.prompt, request.chat)

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        """The ids the model is fed for a prompt: a lone user message through the chat template, else the text
        with the tokenizer's special tokens (a BOS) unless it starts with its own (a rendered chat)."""
        if chat:
            return self.render_ids([{"role": "user", "content": prompt}])
        bos = self.tokenizer.bos_token
        rendered = bos is not None and prompt.startswith(bos)
        return list(self.tokenizer(prompt, add_special_tokens=not rendered)["input_ids"])

    def render_ids(self, messages: Sequence[dict]) -> list[int]:
        if not self.chat_template:  # a base model (or --no-chat-template): the messages' text, one per line
            return list(self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
        return chat_ids(self.tokenizer, list(messages))

    def render_chat(self, messages: Sequence[dict]) -> str:
        """The chat as the model sees it (template applied, generation prompt added), as text."""
        if not self.chat_template:
            return "\n".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def count_prompt_tokens(self, prompt: str, chat: bool) -> int:
        """The prompt's length as a context check must count it: the ids ``encode`` feeds the model."""
        return len(self.prompt_ids(prompt, chat))

    def count_tokens(self, text: str) -> int:
        """Tokens of bare text (a completion's), no special tokens added."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, request: CompletionRequest, result: StreamResult) -> str:
        text = decode_after(self._decode, result.prompt_ids, result.token_ids)
        return cut_at_stop(text, request.stop) if result.finish_reason == "stop" else text

    def _config(self, request: CompletionRequest) -> DecodeConfig:
        greedy = request.temperature == 0
        sampling = SamplingParams(
            do_sample=not greedy, temperature=request.temperature or 1.0, top_k=request.top_k, top_p=request.top_p
        )
        return DecodeConfig(request.max_tokens, sampling, self.method, self.num_draft_tokens, request.stop)

    def _seed(self, request: CompletionRequest) -> int:
        return request.seed if request.seed is not None else random.getrandbits(62)  # a coarse clock repeated seeds

    def _completion(self, request: CompletionRequest, result: StreamResult, seconds: float) -> Completion:
        return Completion(
            text=self._text(request, result),
            finish_reason="length" if result.finish_reason == "length" else "stop",
            prompt_tokens=len(result.prompt_ids),
            completion_tokens=len(result.token_ids),
            logprobs=list(result.logprobs) if request.logprobs else [],
            tokens=token_pieces(self._decode, result.token_ids, result.prompt_ids) if request.logprobs else [],
            seconds=seconds,
        )


def token_pieces(decode: Callable[[list[int]], str], ids: Sequence[int], context: Sequence[int] = ()) -> list[str]:
    """The text each of ``ids`` adds after ``context`` (the prompt's ids), by ``decode_increment``; the last piece
    takes whatever text is still held back (a character cut off by the length limit), so the pieces join to
    ``decode_after(decode, context, ids)``. Example with byte tokens: ["a", 0xC3, 0xA9] -> ["a", "", "é"]."""
    head = list(context[-CONTEXT_TOKENS:])
    every = head + list(ids)
    pieces: list[str] = []
    prefix_offset, read_offset = 0, len(head)
    for end in range(len(head) + 1, len(every) + 1):
        piece, prefix_offset, read_offset = decode_increment(decode, every[:end], prefix_offset, read_offset)
        pieces.append(piece)
    if pieces:
        pieces[-1] += decode_after(decode, head, ids)[len("".join(pieces)) :]
    return pieces


def _has_stop(text: str, stop: Sequence[str]) -> bool:
    return any(s in text for s in stop)


def decode_increment(
    decode: Callable[[list[int]], str], ids: Sequence[int], prefix_offset: int, read_offset: int
) -> tuple[str, int, int]:
    """The text ``ids[read_offset:]`` adds to that of ``ids[:read_offset]``, decoding only ``ids[prefix_offset:]``
    (vLLM's incremental detokenisation): returns (new text, prefix_offset, read_offset) for the next call, which
    start at 0, 0.

    The new text is the window's decode minus the decode of its first ``read_offset - prefix_offset`` tokens, so
    what a tokenizer does at the start of a text (SentencePiece drops a leading space) cancels out. Nothing is
    taken while the window's text ends in U+FFFD (a multi-byte character whose bytes have not all arrived).
    Example with byte tokens, calls after each token: ["a"] -> ("a", 0, 1); ["a", 0xC3] -> ("", 0, 1) (the window
    reads "a\ufffd"); ["a", 0xC3, 0xA9] -> ("é", 1, 3) (the window reads "aé", its first token "a").
    """
    before = decode(list(ids[prefix_offset:read_offset]))
    window = decode(list(ids[prefix_offset:]))
    if len(window) <= len(before) or window.endswith("\ufffd"):
        return "", prefix_offset, read_offset
    return window[len(before) :], read_offset, len(ids)
