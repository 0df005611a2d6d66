"""The OpenAI-compatible HTTP API over any ``AsyncBackend`` (``spectot serve``).

``create_app(backend)`` serves ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``,
streamed (server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``) or not. A request with
``n`` choices (times the prompts of a batched completion) becomes that many ``CompletionRequest``s; all requests,
from all clients, are simply awaited concurrently and the backend batches them. A client that disconnects
cancels its generations.

Seeds: with a ``seed``, a prompt's choice 0 is seeded ``seed`` itself (so a request for one completion samples
what the backend samples in-process with that seed) and choice j >= 1 the seed ``stream_seeds(seed, "choice")``
gives it, a hash of (seed, j): requests seeded 100 and 101 share no sample (with ``seed + j`` they shared n - 1).

Sampling: a ``temperature`` below 1e-5 is greedy decoding (as vLLM: 1 / T would overflow the logits to NaN);
``top_k`` (vLLM's extra field; 0 or -1: off) reaches the backend. vLLM's other sampling fields
(``repetition_penalty``, ``min_p``, ``min_tokens``, ``ignore_eos``, ... see ``VLLM_NO_OP``) are refused with a
400 when set to anything but their no-op value, rather than silently ignored; so are more than 16 stop strings,
or one of more than 512 characters (the engine looks for each after every token).

Each prompt is tokenised once, on a worker thread (a 6 MB prompt kept the event loop, and every other client,
waiting seconds), and a backend that offers ``prompt_ids`` gets those ids with every choice instead of the text
to tokenise again. A request body over ``max_body_mb`` is answered 413.

Bad requests get OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid or
unsupported parameters (pydantic's validation errors included, as vLLM does; an explicit ``null`` means the
field's default, as in OpenAI's API), and for a ``ValueError`` the backend raises over a request (its fault:
an empty or too long prompt, ...), 404 for an unknown model, 413 for a body over the limit, 500 for any other
failure of the backend, and 503 once the backend can serve no more (``failure()``: the local engine's worker
stopped after a failed step) or the server is shutting down.

Health: ``GET /health`` is 200 while requests can be served, else 503 with an error body that says why (the
backend's ``failure()``, or the shutdown), so a load balancer stops sending work to a server that would fail it.

Shutdown (``serve``: SIGINT or SIGTERM): no new connection is taken; requests in flight run on for
``shutdown_grace`` seconds, then each still running is cancelled and answered 503 with an error body (a stream
ends with an in-band error event, then ``data: [DONE]``); then the backend is closed.

Backends may offer, beyond the protocol: ``render_chat(messages) -> str`` (the chat template applied, so any
conversation can be served; without it, only a single user message, passed on with ``chat=True``),
``prompt_ids(prompt, chat) -> list[int]`` (the ids the model is fed for a request's prompt, special tokens such
as a BOS included: counted, and passed on as the request's ``prompt_ids``), ``count_prompt_tokens(prompt, chat)
-> int`` (their number, for a backend without ``prompt_ids``), ``count_tokens(text) -> int`` (text alone: the
prompt count of a backend without either, and streamed usage) and ``max_context`` (prompt-length checks).

A streamed choice's ``finish_reason`` and token counts (the prompt's too) are those of the ``Completion`` that
ends the backend's stream; for a backend whose stream ends without one, they are re-derived from the text with
``count_tokens`` ("length" when the text has ``max_tokens`` tokens). Streamed responses carry no logprobs (asking for both is
refused); with logprobs, a choice gives each sampled token's text (the piece it adds to the choice's text) and,
for completions, its offset in that text. One request may ask for at most ``max_choices`` completions (prompts times ``n``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import uvicorn
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
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spectot.backends.base import AsyncBackend, Completion, CompletionRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHOICES = 256  # completions one request may ask for (prompts x n): OpenAI's n <= 128, and some room
DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) for completions; chat's too when the context length is unknown
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed, as vLLM takes (torch refuses seeds past 2**64 - 1)
GREEDY_BELOW = 1e-5  # a temperature below this is greedy decoding (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow
MAX_STOP_STRINGS = 16  # the engine looks for every stop string after every token of the request
MAX_STOP_LENGTH = 512  # characters; a stop string also holds back that much streamed text
DEFAULT_MAX_BODY_MB = 32.0  # the largest request body (a prompt of some 8M tokens); more is a 413
DEFAULT_SHUTDOWN_GRACE = 5.0  # seconds requests in flight may run on after a shutdown signal; then they get a 503
SHUTDOWN_MARGIN = 2.0  # seconds uvicorn waits past the grace period for those 503s to be written
SHUTTING_DOWN = "the server is shutting down: send the request again (to another server)"

# vLLM's sampling fields this server cannot honour, each with its value that changes nothing (null is the default
# too): any other value is refused, as an unsupported parameter, rather than silently ignored.
VLLM_NO_OP: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "stop_token_ids": [],
    "bad_words": [],
    "allowed_token_ids": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
    "logits_processors": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
}


# vLLM's chat fields that change how the messages become the prompt; each with its value that changes nothing.
CHAT_NO_OP: dict[str, Any] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "echo": False,
    "add_special_tokens": False,
    "chat_template": None,
    "chat_template_kwargs": {},
    "documents": None,
}


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
        if not loc and error.get("type") in ("model_attributes_type", "dict_type"):  # a form or text body (curl -d)
            parts.append("the body must be a JSON object, sent with 'Content-Type: application/json'")
            params.append(None)
            continue
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
        where = _not_unicode(data)
        if where is not None:  # JSON's "\ud800" escape: a string no tokenizer (nor an error message) can encode
            raise ValueError(f"{where} is not valid Unicode text (a lone surrogate)")
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required() or fields[key].default is None
        }


def _not_unicode(value: Any, at: str = "") -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode (holds a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return at or "a string"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if _not_unicode(key) is not None:  # a field name: it cannot be named either
            return at or "a field name"
        where = _not_unicode(item, f"{at}.{key}" if at else str(key))
        if where is not None:
            return where
    return None


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) for x in value)


def _not_a_no_op(extra: dict[str, Any], no_ops: dict[str, Any]) -> tuple[str, str] | None:
    """(param, why) for the first field of ``no_ops`` that ``extra`` sets to another value than its no-op one."""
    for name, no_op in no_ops.items():
        value = extra.get(name)
        if value is not None and value != no_op:
            return name, f"{name} is not supported (only {json.dumps(no_op)}, which changes nothing)"
    return None


class StreamOptions(OpenAIBody):
    include_usage: StrictBool = False


class SamplingBody(OpenAIBody):
    """What completions and chat completions share; unknown fields are ignored, as vLLM does, but kept
    (``model_extra``): vLLM's sampling fields set to what this server cannot do are refused (``VLLM_NO_OP``)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None  # None: the served model
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: completions 16; chat the rest of the context
    temperature: StrictFloat = Field(1.0, ge=0.0)  # below GREEDY_BELOW: greedy
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)  # vLLM's: the k likeliest tokens only; 0 or -1: off
    n: StrictInt = Field(1, ge=1, le=128)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None  # "" would match at once: every output empty
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    logit_bias: dict[str, StrictFloat] | None = None

    @field_validator("stop")
    @classmethod
    def stop_strings_are_few_and_short(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are taken, got {len(strings)}")
        longest = max(strings, key=len, default="")
        if len(longest) > MAX_STOP_LENGTH:
            raise ValueError(f"a stop string may have at most {MAX_STOP_LENGTH} characters, got one of {len(longest)}")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a parameter this server cannot honour; None when all can be."""
        if self.stream_options is not None and not self.stream:  # as OpenAI answers it
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return param, f"{param} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return _not_a_no_op(self.model_extra or {}, VLLM_NO_OP)


class CompletionBody(SamplingBody):
    # a list is a batch of prompts (not token ids); an empty prompt gives the model nothing to continue
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(None, ge=1)
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def text_not_token_ids(cls, prompt: Any) -> Any:
        """A prompt of another type named in one sentence (OpenAI's token-id prompts, a list of ids or of such
        lists, as what they are), not as the union's validator errors, one per member and item."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(x, str) for x in prompt)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            if not texts:
                raise PydanticCustomError("prompt_empty", "an empty list holds no prompt")
            empty = [i for i, text in enumerate(texts) if not text]
            if empty:  # it would give the model nothing to continue
                where = "the prompt" if isinstance(prompt, str) else f"prompt {empty[0]}"
                raise PydanticCustomError("prompt_empty", f"{where} is empty: give the model text to continue")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) or _int_list(x) for x in prompt):
            raise PydanticCustomError(
                "token_ids", "token-id prompts are not supported: send the text (a string, or a list of strings)"
            )
        raise PydanticCustomError("prompt_type", "a prompt is a string or a list of strings")

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of is not None and self.best_of > 1:
            return "best_of", "best_of > 1 is not supported: ask for n completions and rank them yourself"
        if self.best_of is not None and self.best_of < self.n:  # as OpenAI answers it
            return "best_of", f"best_of must be at least n ({self.n}), got {self.best_of}"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.logprobs is not None and self.logprobs > 1:
            return "logprobs", "logprobs > 1 is not supported: this server returns the sampled token's logprob only"
        response_format = (self.model_extra or {}).get("response_format")
        text = isinstance(response_format, dict) and response_format.get("type", "text") == "text"
        if response_format is not None and not text:
            return "response_format", "response_format other than text is not supported"
        if self.stream and self.logprobs is not None:
            return "logprobs", "logprobs are not returned when streaming: set stream to false"
        if self.logprobs == 1 and self.temperature >= GREEDY_BELOW:
            return "logprobs", (
                "logprobs 1 is only supported with greedy decoding (temperature 0), where the likeliest token is the "
                "sampled one; logprobs 0 gives the sampled token's logprob at any temperature"
            )
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
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


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
        extra = self.model_extra or {}
        if extra.get("functions"):
            return "functions", "functions are not supported"
        if extra.get("tool_choice") not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported (no tools)"
        refused = _not_a_no_op(extra, CHAT_NO_OP)  # vLLM's fields that change the prompt the model is fed
        if refused is not None:
            return refused
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "response_format other than text is not supported"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs > 0 is not supported: this server returns the sampled token's only"
        if self.stream and self.logprobs:
            return "logprobs", "logprobs are not returned when streaming: set stream to false"
        return super().unsupported()


# -- planning: bodies -> backend requests ---------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One prompt as planned: its text (or rendered chat), and what the backend could tell of its tokens."""

    text: str
    chat: bool  # a lone user message the backend puts through its chat template
    tokens: int | None  # the tokens the model is fed, when the backend can count them
    ids: tuple[int, ...] | None  # those tokens, when the backend offers ``prompt_ids``: every choice reuses them


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


def tokenise(backend: AsyncBackend, text: str, chat: bool, seen: str | None) -> Prompt:
    """The request ``(text, chat)`` as the model is fed it: the backend's own ids where it offers ``prompt_ids`` (a
    BOS its tokenizer adds included), else its count (``count_prompt_tokens``, else ``count_tokens`` of ``seen``,
    the prompt as the model sees it); neither when the backend can tell neither. Blocking: run it off the loop."""
    ids: Callable[[str, bool], list[int]] | None = getattr(backend, "prompt_ids", None)
    if ids is not None:
        fed = tuple(ids(text, chat))
        return Prompt(text, chat, len(fed), fed)
    exact: Callable[[str, bool], int] | None = getattr(backend, "count_prompt_tokens", None)
    if exact is not None:
        return Prompt(text, chat, exact(text, chat), None)
    count: Callable[[str], int] | None = getattr(backend, "count_tokens", None)
    return Prompt(text, chat, count(seen) if count is not None and seen is not None else None, None)


def token_budget(
    backend: AsyncBackend, prompt: Prompt, max_tokens: int | None, field: str, where: str, default: int | None = None
) -> int:
    """The max_tokens to ask for with ``prompt`` (``where``: how the error names it, "prompt 2"), checked against
    the backend's context length; a prompt of no tokens at all is refused (the model has nothing to continue).

    With its tokens unknown nothing is checked; without ``max_tokens`` the completion gets ``default`` tokens
    (completions: 16, OpenAI's and vLLM's) or the rest of the context if less, or with no default the rest of the
    context (chat, vLLM's default), or 16 tokens when the context length is unknown.
    """
    tokens = prompt.tokens
    if tokens == 0:
        raise ApiError(400, f"{where} has no tokens (whitespace only?): give the model text to continue", field)
    max_context: int | None = getattr(backend, "max_context", None)
    if tokens is None or max_context is None:
        return max_tokens if max_tokens is not None else (default or DEFAULT_MAX_TOKENS)
    rest = max(1, max_context - tokens)
    budget = max_tokens if max_tokens is not None else min(default or rest, rest)
    if tokens + budget > max_context:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{tokens + budget} tokens ({tokens} in the {field}, {budget} in the completion). "
            f"Please reduce the length of the {field} or completion.",
            field,
            "context_length_exceeded",
        )
    return budget


def check_choices(prompts: int, n: int, max_choices: int) -> None:
    """One request may ask for at most ``max_choices`` completions: each holds KV and a decoding stream."""
    if prompts * n > max_choices:
        raise ApiError(
            400,
            f"this request asks for {prompts * n} completions ({prompts} prompt(s) x n = {n}); this server answers "
            f"at most {max_choices} per request: send fewer prompts or a smaller n",
            "n" if prompts == 1 else "prompt",
        )


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seeds of a prompt's ``n`` choices (see the module doc): ``seed`` itself, then choice j's hash of
    (seed, j); all None without a seed (the backend picks them)."""
    if seed is None:
        return [None] * n
    from spectot.spec.decoding import stream_seeds  # torch comes with it: loaded by the first seeded request

    return [seed, *stream_seeds(seed, "choice", n=n - 1, first=1)]


def plan(prompts: Sequence[Prompt], budgets: Sequence[int], body: SamplingBody, logprobs: bool) -> Plan:
    """Each prompt ``n`` times, seeded by ``choice_seeds``."""
    temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
    seeds = choice_seeds(body.seed, body.n)
    requests: list[CompletionRequest] = []
    for prompt, max_tokens in zip(prompts, budgets):
        for seed in seeds:
            try:
                requests.append(
                    CompletionRequest(
                        prompt.text,
                        max_tokens=max_tokens,
                        temperature=temperature,
                        top_p=body.top_p,
                        top_k=max(body.top_k, 0),
                        stop=body.stop_strings(),
                        seed=seed,
                        logprobs=logprobs,
                        chat=prompt.chat,
                        prompt_ids=prompt.ids,
                    )
                )
            except ValueError as exc:
                raise ApiError(400, str(exc)) from exc
    return Plan(requests, [p.tokens for p in prompts], body.n)


def plan_completion(backend: AsyncBackend, body: CompletionBody, max_choices: int = DEFAULT_MAX_CHOICES) -> Plan:
    """Blocking (it tokenises every prompt): run it off the event loop."""
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    check_choices(len(texts), body.n, max_choices)  # before any prompt is tokenised
    prompts = [tokenise(backend, text, False, text) for text in texts]
    budgets = [
        token_budget(backend, p, body.max_tokens, "prompt", f"prompt {i}", DEFAULT_MAX_TOKENS)
        for i, p in enumerate(prompts)
    ]
    return plan(prompts, budgets, body, body.logprobs is not None)


def plan_chat(backend: AsyncBackend, body: ChatBody) -> Plan:
    """A lone user message goes to the backend with ``chat=True`` (it applies its chat template to token ids,
    exactly as ``Pipeline.encode`` does); any other conversation is rendered to text with ``render_chat``, and fed
    as the template's own ids where the backend offers ``render_ids``.
    Blocking (it renders and tokenises): run it off the event loop."""
    # "developer" is OpenAI's newer name for "system"; templates know only the older one (some drop roles they do not
    # know, and the instructions with them)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    render: Callable[[list[dict]], str] | None = getattr(backend, "render_chat", None)
    rendered: str | None = None
    if render is not None:
        try:
            rendered = render(messages)
        except Exception as exc:  # a template's own refusal (roles must alternate, ...) is the request's fault
            raise ApiError(400, f"cannot apply the chat template to these messages: {exc}", "messages") from exc
    if len(messages) == 1 and messages[0]["role"] == "user":
        text, chat = messages[0]["content"], True
    elif rendered is not None:
        text, chat = rendered, False
    else:
        raise ApiError(
            400,
            f"backend {backend.name} takes a single user message per chat request (it has no chat template to "
            "render a conversation with)",
            "messages",
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    render_ids: Callable[[list[dict]], list[int]] | None = getattr(backend, "render_ids", None)
    if not chat and render_ids is not None:  # the template's own ids: the rendered text tokenised anew got the BOS
        fed = tuple(render_ids(messages))  # a tokenizer adds where the template writes none (vLLM feeds these)
        prompt = Prompt(text, False, len(fed), fed)
    else:
        prompt = tokenise(backend, text, chat, rendered)
    return plan(
        [prompt], [token_budget(backend, prompt, max_tokens, "messages", "the conversation")], body, body.logprobs
    )


def refuse_unsupported(body: SamplingBody) -> None:
    found = body.unsupported()
    if found is not None:
        raise ApiError(400, found[1], found[0], "unsupported_parameter")


def generation_error(exc: Exception, backend: AsyncBackend) -> ApiError:
    """A failed generation's answer: an ``ApiError`` is its own (a shutdown's 503); once the backend can serve no
    more (``failure()``: an engine step failed, whatever the error's type) 503, the server's fault; else a
    ``ValueError`` is the backend finding the request at fault (400, with its message), as is an upstream server's
    4xx passed on by a remote backend (its ``status``, e.g. a vLLM behind the OpenAI backend); anything else is the
    server's fault (500)."""
    if isinstance(exc, ApiError):
        return exc
    if (failure := backend.failure()) is not None:  # a ValueError from a failed step is no fault of the request's
        logger.error("generation failed: the backend stopped", exc_info=exc)
        return ApiError(503, failure, code="service_unavailable")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 400 <= status < 500:
        return ApiError(status, str(exc))
    logger.error("generation failed", exc_info=exc)
    return ApiError(500, f"generation failed: {exc}")


# -- running: concurrently, until done, the client leaves or the server shuts down ----------------------------
class Shutdown:
    """The server's shutdown as its requests see it: ``begin(grace)`` when it starts; ``grace`` seconds later the
    requests still running are cut: each is cancelled and answered 503 (a stream: an error event, then
    ``data: [DONE]``) before uvicorn would cancel it into a bare 500. ``cut()`` is a future of the running loop
    that resolves then (at once when the cut has come)."""

    def __init__(self) -> None:
        self.began = False
        self._over = False
        self._waiting: set[asyncio.Future[None]] = set()

    def begin(self, grace: float) -> None:
        """Call on the serving loop."""
        self.began = True
        asyncio.get_running_loop().call_later(grace, self._cut_all)

    @contextlib.contextmanager
    def cut(self) -> Iterator[asyncio.Future[None]]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._over:
            future.set_result(None)
        self._waiting.add(future)
        try:
            yield future
        finally:
            self._waiting.discard(future)
            future.cancel()

    def _cut_all(self) -> None:
        self._over = True
        for future in self._waiting:
            if not future.done():
                future.set_result(None)


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


async def settle(request: Request, work: asyncio.Task, cut: asyncio.Future[None]) -> Literal["done", "left", "cut"]:
    """Await ``work``, unless the client disconnects ("left") or the server's shutdown cuts it ("cut") first: then
    it is cancelled, and the backend has let go of it when this returns."""
    watch = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch, cut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})
    if not work.cancelled():
        return "done"
    return "cut" if cut.done() and not cut.cancelled() else "left"


StreamEvent = str | Completion | None  # a piece of text, the choice's Completion, or None: the choice has ended


async def stream_all(
    backend: AsyncBackend, requests: Sequence[CompletionRequest], cut: asyncio.Future[None]
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(choice, event) from all streams as they arrive: its text pieces, its ``Completion`` (when the backend
    gives one) and, once the choice has ended, None. ``cut`` resolving (the shutdown) raises a 503 ``ApiError``.

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

    def on_cut(future: asyncio.Future[None]) -> None:
        if not future.cancelled():
            queue.put_nowait((-1, None, ApiError(503, SHUTTING_DOWN)))

    cut.add_done_callback(on_cut)
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
        cut.remove_done_callback(on_cut)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


class BodyLimit:
    """ASGI middleware: a request body of more than ``max_bytes`` is answered 413 with OpenAI's error body before the
    app sees it, by its Content-Length before any of it is read, else once the bytes received pass the limit. A
    body within it is read whole and handed on (FastAPI reads it whole anyway)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the whole body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self.refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:  # the body once, then what the client sends next (its disconnect)
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        megabytes = self.max_bytes / 2**20
        message = f"the request body is larger than this server takes ({megabytes:g} MB, --max-body-mb)"
        error = ApiError(413, message, code="request_too_large")
        await JSONResponse(error.body(), status_code=413)(scope, receive, send)


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
        "logprobs": text_logprobs(completion) if logprobs else None,
        "finish_reason": completion.finish_reason,
    }


def text_logprobs(completion: Completion) -> dict[str, Any]:
    """The legacy completions' logprobs: each sampled token's text, log-probability and character offset in the
    choice's text (vLLM's offsets without echo; the last tokens may run past a stop string the text was cut at),
    and per token its top_logprobs: the sampled token's own entry (vLLM's at logprobs 0; at logprobs 1, which
    needs greedy decoding, it is the likeliest token). Token texts, offsets and top_logprobs are null from a
    backend that does not give the texts."""
    pieces = completion.tokens or None
    offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)) if pieces else None
    top = [{piece: lp} for piece, lp in zip(pieces, completion.logprobs)] if pieces else None
    return {"tokens": pieces, "token_logprobs": completion.logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_choice(index: int, completion: Completion, logprobs: bool) -> dict[str, Any]:
    pieces: Sequence[str | None] = completion.tokens or [None] * len(completion.logprobs)  # None: not given
    content = [
        {
            "token": piece or "",
            "logprob": lp,
            "bytes": None if piece is None else list(piece.encode()),
            "top_logprobs": [],
        }
        for piece, lp in zip(pieces, completion.logprobs, strict=True)
    ]
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
    backend: AsyncBackend, work: Plan, chat: bool, include_usage: bool, header: dict[str, Any], shutdown: Shutdown
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
        with shutdown.cut() as cut:
            async with contextlib.aclosing(stream_all(backend, work.requests, cut)) as pieces:
                async for index, event in pieces:
                    if isinstance(event, Completion):
                        endings[index] = event
                        continue
                    if event is not None:
                        texts[index] += event
                        part = {"delta": {"content": event}} if chat else {"text": event}
                        yield chunk([{"index": index, **part, "logprobs": None, "finish_reason": None}])
                        continue
                    max_tokens = work.requests[index].max_tokens
                    reason, _ = streamed_ending(backend, texts[index], max_tokens, endings[index])
                    part = {"delta": {}} if chat else {"text": ""}
                    yield chunk([{"index": index, **part, "logprobs": None, "finish_reason": reason}])
    except Exception as exc:  # the status line is sent: report in-band, as vLLM does
        yield sse(generation_error(exc, backend).body())
    else:
        if include_usage:
            # each prompt once, counted as its first choice's Completion says (as non-streamed usage), else as planned
            prompt = sum(
                ending.prompt_tokens if ending is not None else counted or 0
                for counted, ending in zip(work.prompt_tokens, endings[:: work.n])
            )
            completion = sum(
                streamed_ending(backend, t, r.max_tokens, e)[1] for t, r, e in zip(texts, work.requests, endings)
            )
            yield sse({**header, "choices": [], "usage": usage(prompt, completion)})
    yield sse("[DONE]")


# -- the app ---------------------------------------------------------------------------------------------------
def create_app(
    backend: AsyncBackend,
    max_choices: int = DEFAULT_MAX_CHOICES,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    owns_backend: bool = False,
) -> FastAPI:
    """The OpenAI-compatible API over ``backend``. ``max_choices``: the most completions one request may ask for
    (its prompts times ``n``); ``max_body_mb``: the largest request body (MB of 2**20 bytes); ``owns_backend``: the
    app closes the backend when the server shuts down (``serve``), else the caller does.

    ``app.state.shutdown`` is the app's ``Shutdown``: a ``GracefulServer`` begins it."""
    if max_choices < 1:
        raise ValueError(f"max_choices must be >= 1, got {max_choices}")
    if not (math.isfinite(max_body_mb) and max_body_mb > 0):
        raise ValueError(f"max_body_mb must be a number > 0, got {max_body_mb}")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_backend:  # after the shutdown's requests have ended
            await backend.aclose()

    app = FastAPI(title="spectot", summary="OpenAI-compatible completions over a spectot backend", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=int(max_body_mb * 2**20))
    shutdown = app.state.shutdown = Shutdown()

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's body, never plain text
        logger.error("request failed", exc_info=exc)
        error = ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    def unavailable() -> str | None:
        """Why no request can be served now, or None."""
        return SHUTTING_DOWN if shutdown.began else backend.failure()

    def check_available() -> None:
        why = unavailable()
        if why is not None:
            raise ApiError(503, why, code="service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        check_available()
        return Response(status_code=200)

    def model_card() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": backend.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "spectot",
        }
        max_context = getattr(backend, "max_context", None)
        if max_context is not None:
            card["max_model_len"] = max_context
        return card

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # the openai client's models.retrieve; a hub id holds a slash
    async def model(model: str) -> dict[str, Any]:
        check_model(backend, model)
        return model_card()

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
            events = stream_events(backend, work, chat, include_usage, header, shutdown)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        task = asyncio.create_task(complete_all(backend, work.requests))
        with shutdown.cut() as cut:
            outcome = await settle(request, task, cut)
        if outcome == "left":
            logger.info("client left: cancelled %d request(s)", len(work.requests))
            return Response(status_code=499)
        if outcome == "cut":
            raise ApiError(503, SHUTTING_DOWN, code="service_unavailable")
        try:
            completions = task.result()
        except Exception as exc:
            raise generation_error(exc, backend) from exc
        make_choice = chat_choice if chat else text_choice
        choices = [make_choice(i, c, logprobs) for i, c in enumerate(completions)]
        return {**header, "choices": choices, "usage": usage_of(work, completions)}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response | dict[str, Any]:
        check_available()
        check_model(backend, body.model)
        refuse_unsupported(body)
        work = await asyncio.to_thread(plan_completion, backend, body, max_choices)
        return await respond(request, work, False, body, body.logprobs is not None)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody, request: Request) -> Response | dict[str, Any]:
        check_available()
        check_model(backend, body.model)
        refuse_unsupported(body)
        check_choices(1, body.n, max_choices)
        work = await asyncio.to_thread(plan_chat, backend, body)
        return await respond(request, work, True, body, body.logprobs)

    return app


# -- serving ---------------------------------------------------------------------------------------------------
class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown gives the app's requests in flight ``grace`` seconds and then cuts them (the
    app's ``Shutdown``: a 503 each), before uvicorn's own deadline (``SHUTDOWN_MARGIN`` later) would cancel them
    into bare 500s. An app without a ``Shutdown`` gets uvicorn's plain shutdown after the same grace."""

    def __init__(self, app: FastAPI, grace: float = DEFAULT_SHUTDOWN_GRACE, **config: Any) -> None:
        if not grace >= 0:
            raise ValueError(f"the shutdown grace must be >= 0 seconds, got {grace}")
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace + SHUTDOWN_MARGIN, **config))
        self.grace = grace
        self.requests: Shutdown | None = getattr(app.state, "shutdown", None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.requests is not None:
            self.requests.begin(self.grace)
        await super().shutdown(sockets)


def serve(
    backend: AsyncBackend,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    max_choices: int = DEFAULT_MAX_CHOICES,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
    sock: socket.socket | None = None,
) -> None:
    """Serve ``backend`` until SIGINT or SIGTERM (blocking), on ``sock`` if given (``bind``), else at (host, port);
    requests in flight then get ``shutdown_grace`` seconds
    (see the module doc) and the backend is closed: by the app's lifespan, before uvicorn hands the signal on to
    its default handler (which ends the process on a SIGTERM)."""
    app = create_app(backend, max_choices, max_body_mb, owns_backend=True)
    server = GracefulServer(app, shutdown_grace, host=host, port=port, log_level=log_level)
    listening = bind(host, port) if sock is None else sock
    asyncio.run(server.serve(sockets=[listening]))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket at (host, port) (port 0: one the OS picks; ``getsockname()`` tells which), bound
    before the server starts so the caller can say where it serves, or a ValueError naming the address (a busy
    port, an address this machine does not have)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as err:
        listening.close()
        raise ValueError(f"cannot listen at {host}:{port}: {err.strerror or err}") from None
    listening.listen(2048)
    return listening


class BackgroundServer:
    """An app served by uvicorn on a thread of its own (tests, notebooks): ``with BackgroundServer(app) as s: s.url``.

    ``port=0`` takes a free port; the socket is bound before the thread starts, so ``url`` is valid at once.
    ``stop()`` shuts down as ``serve`` does on a signal, requests in flight getting ``shutdown_grace`` seconds.
    """

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        shutdown_grace: float = 0.0,
    ) -> None:
        self._socket = bind(host, port)
        self.host, self.port = self._socket.getsockname()[:2]
        self._server = GracefulServer(app, shutdown_grace, log_level=log_level)
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
