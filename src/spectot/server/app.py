"""The OpenAI-compatible HTTP API over any ``AsyncBackend`` (``spectot serve``).

``create_app(backend)`` serves ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``,
streamed (server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``) or not. A request with
``n`` choices (times the prompts of a batched completion) becomes that many ``CompletionRequest``s, the j-th
with ``seed + j`` when a seed is given; all requests, from all clients, are simply awaited concurrently and the
backend batches them. A client that disconnects cancels its generations.

Bad requests get OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid or
unsupported parameters (pydantic's validation errors included, as vLLM does; an explicit ``null`` means the
field's default, as in OpenAI's API), and for a ``ValueError`` the backend raises over a request (its fault:
an empty or too long prompt, ...), 404 for an unknown model, 500 for any other failure of the backend.

Backends may offer, beyond the protocol: ``render_chat(messages) -> str`` (the chat template applied, so any
conversation can be served; without it, only a single user message, passed on with ``chat=True``),
``count_prompt_tokens(prompt, chat) -> int`` (the tokens the model is fed for a request's prompt, special tokens
such as a BOS included), ``count_tokens(text) -> int`` (text alone: the prompt count of a backend without
``count_prompt_tokens``, and streamed usage) and ``max_context`` (prompt-length checks).

A streamed choice's ``finish_reason`` and token counts are those of the ``Completion`` that ends the backend's
stream; for a backend whose stream ends without one, they are re-derived from the text with ``count_tokens``
("length" when the text has ``max_tokens`` tokens). Streamed responses carry no logprobs (asking for both is
refused). One request may ask for at most ``max_choices`` completions (prompts times ``n``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from spectot.backends.base import AsyncBackend, Completion, CompletionRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHOICES = 256  # completions one request may ask for (prompts x n): OpenAI's n <= 128, and some room
DEFAULT_MAX_TOKENS = 16  # OpenAI's default, used when the backend's context length is unknown
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed, as vLLM takes (torch refuses seeds past 2**64 - 1)


# -- errors ------------------------------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's errors as one 400, e.g. 'max_tokens: Input should be greater than or equal to 1'.

    ``param`` is the top-level field (as OpenAI reports it); the message gives each error's full path.
    """
    parts, params = [], []
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # its loc is ("body", character offset): no parameter to name
            at, why = error.get("loc", ("body", "?"))[-1], error.get("ctx", {}).get("error", "JSON decode error")
            parts.append(f"the body is not valid JSON (character {at}): {why}")
            params.append(None)
            continue
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        params.append(loc[0] if loc else None)
        parts.append(f"{'.'.join(loc)}: {error.get('msg', 'invalid')}" if loc else str(error.get("msg", "invalid")))
    return ApiError(400, "; ".join(parts) or "invalid request body", params[0] if params else None)


# -- request bodies ----------------------------------------------------------------------------------------------
NonEmptyStr = Annotated[str, StringConstraints(strict=True, min_length=1)]


class OpenAIBody(BaseModel):
    """A request body as OpenAI's API reads it: ``null`` is the field's default (the official client sends nulls),
    and JSON's non-standard Infinity and NaN (which Python's parser accepts) are no numbers."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required() or fields[key].default is None
        }


class StreamOptions(OpenAIBody):
    include_usage: StrictBool = False


class SamplingBody(OpenAIBody):
    """What completions and chat completions share; unknown fields are ignored, as vLLM does."""

    model: StrictStr | None = None  # None: the served model
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: the rest of the context (16 when unknown)
    temperature: StrictFloat = Field(1.0, ge=0.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=128)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None  # "" would match at once: every output empty
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    logit_bias: dict[str, StrictFloat] | None = None

    @field_validator("seed")
    @classmethod
    def every_choice_seed_fits(cls, seed: int | None, info: ValidationInfo) -> int | None:
        """The j-th of ``n`` choices is seeded ``seed + j``: the last one must fit in 64 bits too."""
        n = info.data.get("n")
        if seed is not None and n is not None and seed + n - 1 > SEED_MAX:
            raise ValueError(f"seed + n - 1 must be at most {SEED_MAX} (choice j is seeded seed + j): lower the seed")
        return seed

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a parameter this server cannot honour; None when all can be."""
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return param, f"{param} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionBody(SamplingBody):
    # a list is a batch of prompts (not token ids); an empty prompt gives the model nothing to continue
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(None, ge=1)
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of is not None and self.best_of > 1:
            return "best_of", "best_of > 1 is not supported: ask for n completions and rank them yourself"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.logprobs is not None and self.logprobs > 1:
            return "logprobs", "logprobs > 1 is not supported: this server returns the sampled token's logprob only"
        if self.stream and self.logprobs is not None:
            return "logprobs", "logprobs are not returned when streaming: set stream to false"
        return super().unsupported()


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "response_format other than text is not supported"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs > 0 is not supported: this server returns the sampled token's only"
        if self.stream and self.logprobs:
            return "logprobs", "logprobs are not returned when streaming: set stream to false"
        return super().unsupported()


# -- planning: bodies -> backend requests ---------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The backend requests of one HTTP request: choice i = prompt i // n, sample i % n."""

    requests: list[CompletionRequest]
    prompt_tokens: list[int | None]  # per prompt, when the backend can count them
    n: int


def check_model(backend: AsyncBackend, model: str | None) -> None:
    if model is not None and model != backend.name:
        message = f"The model `{model}` does not exist (this server serves `{backend.name}`)."
        raise ApiError(404, message, "model", "model_not_found")


def prompt_tokens(backend: AsyncBackend, prompt: str, chat: bool, seen: str | None) -> int | None:
    """The tokens the model is fed for the request ``(prompt, chat)``: the backend's own count where it offers one
    (``count_prompt_tokens``: a BOS its tokenizer adds included), else ``count_tokens`` of ``seen``, the prompt as
    the model sees it; None when neither is known."""
    exact: Callable[[str, bool], int] | None = getattr(backend, "count_prompt_tokens", None)
    if exact is not None:
        return exact(prompt, chat)
    count: Callable[[str], int] | None = getattr(backend, "count_tokens", None)
    return count(seen) if count is not None and seen is not None else None


def token_budget(
    backend: AsyncBackend, tokens: int | None, max_tokens: int | None, field: str
) -> tuple[int | None, int]:
    """(prompt tokens, max_tokens to ask for) of one prompt of ``tokens`` tokens, checked against the backend's
    context length.

    With ``tokens`` None (unknown) nothing is checked; without ``max_tokens`` the completion may fill the rest of
    the context (vLLM's default), or 16 tokens when the context length is unknown.
    """
    max_context: int | None = getattr(backend, "max_context", None)
    if tokens is None or max_context is None:
        return tokens, max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS
    budget = max_tokens if max_tokens is not None else max(1, max_context - tokens)
    if tokens + budget > max_context:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{tokens + budget} tokens ({tokens} in the {field}, {budget} in the completion). "
            f"Please reduce the length of the {field} or completion.",
            field,
            "context_length_exceeded",
        )
    return tokens, budget


def check_choices(prompts: int, n: int, max_choices: int) -> None:
    """One request may ask for at most ``max_choices`` completions: each holds KV and a decoding stream."""
    if prompts * n > max_choices:
        raise ApiError(
            400,
            f"this request asks for {prompts * n} completions ({prompts} prompt(s) x n = {n}); this server answers "
            f"at most {max_choices} per request: send fewer prompts or a smaller n",
            "n" if prompts == 1 else "prompt",
        )


def plan(
    prompts: Sequence[str], budgets: Sequence[tuple[int | None, int]], body: SamplingBody, logprobs: bool, chat: bool
) -> Plan:
    """Each prompt ``n`` times, the j-th sample seeded ``seed + j``."""
    requests: list[CompletionRequest] = []
    for prompt, (_, max_tokens) in zip(prompts, budgets):
        for j in range(body.n):
            try:
                requests.append(
                    CompletionRequest(
                        prompt,
                        max_tokens=max_tokens,
                        temperature=body.temperature,
                        top_p=body.top_p,
                        stop=body.stop_strings(),
                        seed=body.seed + j if body.seed is not None else None,
                        logprobs=logprobs,
                        chat=chat,
                    )
                )
            except ValueError as exc:
                raise ApiError(400, str(exc)) from exc
    return Plan(requests, [tokens for tokens, _ in budgets], body.n)


def plan_completion(backend: AsyncBackend, body: CompletionBody, max_choices: int = DEFAULT_MAX_CHOICES) -> Plan:
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    check_choices(len(prompts), body.n, max_choices)  # before any prompt is tokenised
    budgets = [token_budget(backend, prompt_tokens(backend, p, False, p), body.max_tokens, "prompt") for p in prompts]
    return plan(prompts, budgets, body, body.logprobs is not None, chat=False)


def plan_chat(backend: AsyncBackend, body: ChatBody) -> Plan:
    """A lone user message goes to the backend with ``chat=True`` (it applies its chat template to token ids,
    exactly as ``Pipeline.encode`` does); any other conversation is rendered to text with ``render_chat``."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    render: Callable[[list[dict]], str] | None = getattr(backend, "render_chat", None)
    rendered: str | None = None
    if render is not None:
        try:
            rendered = render(messages)
        except Exception as exc:  # a template's own refusal (roles must alternate, ...) is the request's fault
            raise ApiError(400, f"cannot apply the chat template to these messages: {exc}", "messages") from exc
    if len(messages) == 1 and messages[0]["role"] == "user":
        prompt, chat = messages[0]["content"], True
    elif rendered is not None:
        prompt, chat = rendered, False
    else:
        raise ApiError(
            400,
            f"backend {backend.name} takes a single user message per chat request (it has no chat template to "
            "render a conversation with)",
            "messages",
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tokens = prompt_tokens(backend, prompt, chat, rendered)
    return plan([prompt], [token_budget(backend, tokens, max_tokens, "messages")], body, body.logprobs, chat)


def refuse_unsupported(body: SamplingBody) -> None:
    found = body.unsupported()
    if found is not None:
        raise ApiError(400, found[1], found[0], "unsupported_parameter")


def generation_error(exc: Exception) -> ApiError:
    """A failed generation's answer: a ``ValueError`` is the backend finding the request at fault (400, with its
    message), as is an upstream server's 4xx passed on by a remote backend (its ``status``, e.g. a vLLM behind the
    OpenAI backend); anything else is the server's fault (500)."""
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 400 <= status < 500:
        return ApiError(status, str(exc))
    logger.error("generation failed", exc_info=exc)
    return ApiError(500, f"generation failed: {exc}")


# -- running: concurrently, until done or the client leaves --------------------------------------------------
async def complete_all(backend: AsyncBackend, requests: Sequence[CompletionRequest]) -> list[Completion]:
    """All completions at once; the first failure cancels the rest and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(backend.complete(r)) for r in requests]
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects: after the body, the server's next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: asyncio.Task) -> bool:
    """Await ``work``; cancel it and return False if the client disconnects first."""
    watch = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # the backend has let go of the request when this returns
    return not work.cancelled()


StreamEvent = str | Completion | None  # a piece of text, the choice's Completion, or None: the choice has ended


async def stream_all(
    backend: AsyncBackend, requests: Sequence[CompletionRequest]
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(choice, event) from all streams as they arrive: its text pieces, its ``Completion`` (when the backend
    gives one) and, once the choice has ended, None.

    Closing this iterator (or cancelling its consumer) cancels every stream still running.
    """
    queue: asyncio.Queue[tuple[int, StreamEvent, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: CompletionRequest) -> None:
        pieces = backend.stream(request)
        try:
            async for piece in pieces:
                if piece:
                    await queue.put((index, piece, None))
            await queue.put((index, None, None))
        except Exception as exc:
            await queue.put((index, None, exc))
        finally:
            aclose = getattr(pieces, "aclose", None)
            if aclose is not None:
                await aclose()

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            running -= piece is None
            yield index, piece
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


# -- responses -------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_of(work: Plan, completions: Sequence[Completion]) -> dict[str, int]:
    """Each prompt counted once (as OpenAI does for n > 1), every choice's tokens counted."""
    prompt = sum(completions[i * work.n].prompt_tokens for i in range(len(work.prompt_tokens)))
    return usage(prompt, sum(c.completion_tokens for c in completions))


def text_choice(index: int, completion: Completion, logprobs: bool) -> dict[str, Any]:
    return {
        "index": index,
        "text": completion.text,
        # Token strings and offsets are not part of a Completion; the logprobs are the sampled tokens'.
        "logprobs": {"tokens": None, "token_logprobs": completion.logprobs, "top_logprobs": None, "text_offset": None}
        if logprobs
        else None,
        "finish_reason": completion.finish_reason,
    }


def chat_choice(index: int, completion: Completion, logprobs: bool) -> dict[str, Any]:
    content = [{"token": "", "logprob": lp, "bytes": None, "top_logprobs": []} for lp in completion.logprobs]
    return {
        "index": index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": {"content": content} if logprobs else None,
        "finish_reason": completion.finish_reason,
    }


def sse(event: dict[str, Any] | str) -> str:
    return f"data: {event if isinstance(event, str) else json.dumps(event, separators=(',', ':'))}\n\n"


def streamed_ending(backend: AsyncBackend, text: str, max_tokens: int, ending: Completion | None) -> tuple[str, int]:
    """(finish_reason, completion tokens) of a streamed choice: its ``Completion``'s, else re-derived from its
    text (see the module doc)."""
    if ending is not None:
        return ending.finish_reason, ending.completion_tokens
    count: Callable[[str], int] | None = getattr(backend, "count_tokens", None)
    if count is None or not text:
        return "stop", 0
    tokens = count(text)
    return ("length" if tokens >= max_tokens else "stop"), tokens


async def stream_events(
    backend: AsyncBackend, work: Plan, chat: bool, include_usage: bool, header: dict[str, Any]
) -> AsyncIterator[str]:
    """The server-sent events of a streamed request, in OpenAI's chunk format, ending with ``data: [DONE]``."""

    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse({**header, "choices": choices})

    texts = ["" for _ in work.requests]
    endings: list[Completion | None] = [None for _ in work.requests]
    if chat:
        for i in range(len(work.requests)):
            opening = {"role": "assistant", "content": ""}
            yield chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}])
    try:
        async with contextlib.aclosing(stream_all(backend, work.requests)) as pieces:
            async for index, event in pieces:
                if isinstance(event, Completion):
                    endings[index] = event
                    continue
                if event is not None:
                    texts[index] += event
                    part = {"delta": {"content": event}} if chat else {"text": event}
                    yield chunk([{"index": index, **part, "logprobs": None, "finish_reason": None}])
                    continue
                reason, _ = streamed_ending(backend, texts[index], work.requests[index].max_tokens, endings[index])
                part = {"delta": {}} if chat else {"text": ""}
                yield chunk([{"index": index, **part, "logprobs": None, "finish_reason": reason}])
    except Exception as exc:  # the status line is sent: report in-band, as vLLM does
        yield sse(generation_error(exc).body())
    else:
        if include_usage:
            prompt = sum(t or 0 for t in work.prompt_tokens)
            completion = sum(
                streamed_ending(backend, t, r.max_tokens, e)[1] for t, r, e in zip(texts, work.requests, endings)
            )
            yield sse({**header, "choices": [], "usage": usage(prompt, completion)})
    yield sse("[DONE]")


# -- the app ---------------------------------------------------------------------------------------------------
def create_app(backend: AsyncBackend, max_choices: int = DEFAULT_MAX_CHOICES) -> FastAPI:
    """The OpenAI-compatible API over ``backend``; the caller owns the backend (``serve`` closes it).
    ``max_choices``: the most completions one request may ask for (its prompts times ``n``)."""
    if max_choices < 1:
        raise ValueError(f"max_choices must be >= 1, got {max_choices}")
    app = FastAPI(title="spectot", summary="OpenAI-compatible completions over a spectot backend")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": backend.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "spectot",
        }
        max_context = getattr(backend, "max_context", None)
        if max_context is not None:
            card["max_model_len"] = max_context
        return {"object": "list", "data": [card]}

    async def respond(
        request: Request, work: Plan, chat: bool, body: SamplingBody, logprobs: bool
    ) -> Response | dict[str, Any]:
        kind = "chat.completion" if chat else "text_completion"
        header = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind + (".chunk" if chat and body.stream else ""),
            "created": int(time.time()),
            "model": backend.name,
            "system_fingerprint": None,
        }
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = stream_events(backend, work, chat, include_usage, header)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        task = asyncio.create_task(complete_all(backend, work.requests))
        if not await unless_disconnected(request, task):
            logger.info("client left: cancelled %d request(s)", len(work.requests))
            return Response(status_code=499)
        try:
            completions = task.result()
        except Exception as exc:
            raise generation_error(exc) from exc
        make_choice = chat_choice if chat else text_choice
        choices = [make_choice(i, c, logprobs) for i, c in enumerate(completions)]
        return {**header, "choices": choices, "usage": usage_of(work, completions)}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response | dict[str, Any]:
        check_model(backend, body.model)
        refuse_unsupported(body)
        work = plan_completion(backend, body, max_choices)
        return await respond(request, work, False, body, body.logprobs is not None)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody, request: Request) -> Response | dict[str, Any]:
        check_model(backend, body.model)
        refuse_unsupported(body)
        check_choices(1, body.n, max_choices)
        return await respond(request, plan_chat(backend, body), True, body, body.logprobs)

    return app


# -- serving ---------------------------------------------------------------------------------------------------
def serve(
    backend: AsyncBackend,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    max_choices: int = DEFAULT_MAX_CHOICES,
) -> None:
    """Serve ``backend`` until interrupted (blocking), then close it."""
    import uvicorn

    app = create_app(backend, max_choices)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))

    async def run() -> None:
        try:
            await server.serve()
        finally:
            await backend.aclose()

    asyncio.run(run())


class BackgroundServer:
    """An app served by uvicorn on a thread of its own (tests, notebooks): ``with BackgroundServer(app) as s: s.url``.

    ``port=0`` takes a free port; the socket is bound before the thread starts, so ``url`` is valid at once.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
