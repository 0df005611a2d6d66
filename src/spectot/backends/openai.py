"""The black-box backend: completions from one or more OpenAI-compatible servers (vLLM, SGLang, ``spectot serve``).

``OpenAIBackend`` sends each ``CompletionRequest`` to ``/v1/completions`` (``/v1/chat/completions`` when
``request.chat``) with the official ``openai`` client. With several servers, each request goes to the one with
the fewest requests outstanding from this backend (ties: round-robin), so a search's many concurrent requests
spread evenly; a server that could not be reached, or answered a 5xx, is skipped for ``cooldown`` seconds while
another is up.

Failures: a server that cannot be reached (connection refused, connect timeout) passes the request on at once to
a server that is up and that the request has not tried, spending no retry. Other connection errors, 408, 429
and 5xx (and an unreachable server when no untried one is up) are retried with exponential backoff, or after the
server's ``Retry-After`` (capped at ``MAX_RETRY_AFTER``), each retry on another server than the one that just
failed when there is one. Only a refused connection or a connect timeout marks a server unreachable: a
connection dropped after the request went out (a reset, a server that hung up) is retried with backoff like a 5xx,
and leaves the server in the rotation; a 5xx takes the server out of it for ``cooldown`` seconds (a failing server
answers at once, so it has the fewest requests outstanding and would draw most first attempts). A server whose
cooldown has passed takes one probe request at a time until
one succeeds, so a host that swallows packets costs one request a connect timeout, not a burst of them. A read
timeout is not retried: the request already waited the whole timeout, and a retry would most likely wait it out
again (httpx closes the connection, so the server drops the work). Any other 4xx is the request's fault and raises ``OpenAIBackendError`` at once with
the server's message, as does a generation the server aborted (vLLM's finish reason "abort"). Cancellation:
cancelling the awaiting task closes the HTTP connection mid-request (httpx closes a connection whose response
was not read to the end), which is what makes vLLM and ``spectot serve`` abort the generation; ``stream()``
closes its response when the consumer stops early. A request's ``top_k``, which OpenAI's API lacks, is sent as
vLLM's (and ``spectot serve``'s) extra body field.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import openai

from spectot.backends.base import Completion, CompletionRequest, FinishReason

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_RETRY_AFTER = 60.0  # seconds: the longest a server's Retry-After makes a retry wait


class OpenAIBackendError(RuntimeError):
    """A request the server refused (4xx), or one that still failed after every retry."""

    def __init__(self, message: str, status: int | None = None, url: str = "") -> None:
        super().__init__(message)
        self.status = status  # the HTTP status; None for a connection error or a timeout
        self.url = url

    @property
    def refused(self) -> bool:
        """Whether the server refused this request for what it holds (400, 413, 422: a prompt past the model's
        context, say): sent again it fails again, while other requests go on (unlike 401, 404 or 5xx)."""
        return self.status in (400, 413, 422)


@dataclass(eq=False)
class _Server:
    url: str
    client: openai.AsyncOpenAI
    outstanding: int = 0  # requests this backend has in flight there
    down_until: float = 0.0  # time.monotonic() before which it counts as unreachable; 0: it answered since


def check_server_url(url: str, name: str = "server URL") -> None:
    """A ValueError for a server URL that is none: an http(s) scheme and a host are needed (``notaurl`` was taken, and
    every request then failed with a connection error that did not name the URL's fault)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is no number in 0-65535
    except ValueError as err:
        raise ValueError(f"{name} {url}: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name} {url}: expected http(s)://host[:port][/v1], e.g. http://localhost:8000/v1")


def is_read_timeout(exc: BaseException) -> bool:
    """The server took the request but did not answer within the timeout. Read by name: the ``openai`` client
    raises it from ``httpx`` or ``httpx2``'s ``ReadTimeout``, depending on its version."""
    return isinstance(exc, openai.APITimeoutError) and type(exc.__cause__).__name__ == "ReadTimeout"


def is_unreachable(exc: BaseException) -> bool:
    """The request never reached the server: the connection was refused or timed out while connecting (by name,
    as ``is_read_timeout``). A reset or hang-up after the request went out is a connection error but not this."""
    return isinstance(exc, openai.APIConnectionError) and type(exc.__cause__).__name__ in (
        "ConnectError",
        "ConnectTimeout",
    )


def is_retryable(exc: BaseException) -> bool:
    """Connection errors, 408, 429 and 5xx may pass; a read timeout (it would most likely time out again) and
    other statuses (the request's fault) do not."""
    if isinstance(exc, openai.APIConnectionError):
        return not is_read_timeout(exc)
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 429) or exc.status_code >= 500
    return False


def backoff_seconds(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**attempt)] (attempt 0 = first retry;
    the exponent stops at 60, so a long run of retries cannot overflow the float)."""
    return random.uniform(0.0, min(cap, base * 2 ** min(attempt, 60)))


def retry_after_seconds(exc: BaseException) -> float | None:
    """The wait a 429 or 503 asks for in its ``Retry-After`` header (seconds, at most ``MAX_RETRY_AFTER``); None
    when it asks for none (or gives an HTTP date, which is not read)."""
    if not isinstance(exc, openai.APIStatusError) or exc.status_code not in (429, 503):
        return None
    try:
        seconds = float(exc.response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER) if math.isfinite(seconds) else None


def finish_reason(reason: str | None, url: str = "") -> FinishReason:
    """OpenAI's finish reasons mapped onto ours: only "length" is a budget cut, anything else ended the text.

    vLLM's "abort" (the server gave the generation up: shutdown, preemption) is no ending: it raises
    ``OpenAIBackendError`` (``url``: the server's, for the message)."""
    if reason == "abort":
        raise OpenAIBackendError(f"{url or 'the server'} aborted the generation", None, url)
    return "length" if reason == "length" else "stop"


class OpenAIBackend:
    """``AsyncBackend`` over OpenAI-compatible servers; ``model=None`` asks the first server's ``/v1/models``."""

    def __init__(
        self,
        servers: Sequence[tuple[str, openai.AsyncOpenAI]],
        model: str | None = None,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        forward_priority: bool = False,
        cooldown: float = 10.0,
    ) -> None:
        if not servers:
            raise ValueError("OpenAIBackend needs at least one server URL")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._servers = [_Server(url, client) for url, client in servers]
        self._model = model
        self._model_lock = asyncio.Lock()
        self._next = 0  # round-robin cursor among equally loaded servers
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        # vLLM refuses a nonzero ``priority`` unless started with --scheduling-policy priority.
        self.forward_priority = forward_priority
        self.cooldown = cooldown  # seconds a server that could not be reached is skipped (while another is up)

    @classmethod
    def from_urls(
        cls,
        urls: Sequence[str],
        model: str | None = None,
        timeout: float = 120.0,  # BackendOptions' (--timeout) default
        max_retries: int = 3,
        api_key: str = "EMPTY",
        connect_timeout: float = 10.0,
    ) -> OpenAIBackend:
        """One client per base URL (``http://host:port/v1``; a URL without ``/v1`` gets it appended).

        ``timeout`` bounds each wait on a server (each read: for a non-streamed request, the whole generation);
        connecting gets at most ``connect_timeout``, so a host that drops packets costs seconds, not a generation's
        time. The client's own retries are off: this backend retries, possibly on another server.
        """
        limits = openai.Timeout(timeout, connect=min(timeout, connect_timeout))
        servers = []
        for url in urls:
            check_server_url(url)
            base = url.rstrip("/")
            base = base if base.endswith("/v1") else base + "/v1"
            servers.append((base, openai.AsyncOpenAI(base_url=base, api_key=api_key, timeout=limits, max_retries=0)))
        return cls(servers, model=model, max_retries=max_retries)

    @property
    def name(self) -> str:
        return self._model if self._model is not None else self._servers[0].url

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    def outstanding(self) -> list[int]:
        """Requests in flight per server, in URL order."""
        return [s.outstanding for s in self._servers]

    # -- the AsyncBackend protocol -----------------------------------------------------------------------------
    async def complete(self, request: CompletionRequest) -> Completion:
        start = time.perf_counter()
        model = await self.model()
        kwargs = self._arguments(request, model, stream=False)
        api = _chat_api if request.chat else _text_api
        response, server = await self._send(lambda client: api(client).create(**kwargs))
        server.outstanding -= 1
        return self._completion(response, request.chat, time.perf_counter() - start, server.url)

    async def stream(self, request: CompletionRequest) -> AsyncIterator[str | Completion]:
        """The text in pieces as the server sends them, then the ``Completion`` (finish reason from the server,
        token counts from its usage chunk: ``stream_options.include_usage`` is asked for; a server that sends no
        usage leaves the counts 0). Opening the response is retried as ``complete`` is; once it is open, a broken
        stream (or one the server aborts) raises ``OpenAIBackendError``: the pieces already yielded cannot be
        taken back."""
        start = time.perf_counter()
        model = await self.model()
        kwargs = self._arguments(request, model, stream=True)
        api = _chat_api if request.chat else _text_api
        chunks, server = await self._send(lambda client: api(client).create(**kwargs, stream=True))
        pieces: list[str] = []
        reason: str | None = None
        usage: Any = None
        try:
            async for chunk in chunks:
                usage = getattr(chunk, "usage", None) or usage
                if not chunk.choices:
                    continue  # the usage-only chunk
                choice = chunk.choices[0]
                if choice.finish_reason is not None:
                    finish_reason(choice.finish_reason, server.url)  # raises for an aborted generation
                    reason = choice.finish_reason
                piece = (choice.delta.content or "") if request.chat else (choice.text or "")
                if piece:
                    pieces.append(piece)
                    yield piece
        except openai.APIError as exc:  # mid-stream: the pieces sent cannot be taken back, so no retry
            raise OpenAIBackendError(f"{server.url}: the stream broke: {exc.message}", None, server.url) from exc
        finally:
            server.outstanding -= 1
            await chunks.close()  # on early exit or cancellation: closing the response aborts the request
        if reason is None:  # the body ended cleanly mid-generation (a proxy that gave up upstream)
            raise OpenAIBackendError(f"{server.url}: the stream ended without a finish reason", None, server.url)
        yield Completion(
            text="".join(pieces),
            finish_reason=finish_reason(reason, server.url),
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            seconds=time.perf_counter() - start,
        )

    def failure(self) -> str | None:
        """Always None: a server that fails is retried or skipped per request (see the module doc), never for good."""
        return None

    async def aclose(self) -> None:
        for server in self._servers:
            await server.client.close()

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- helpers -----------------------------------------------------------------------------------------------
    async def model(self) -> str:
        """The model name: the one given, else the first model listed by the first server that answers."""
        if self._model is not None:
            return self._model
        async with self._model_lock:
            failures, unreachable = [], 0
            for server in self._servers:
                if self._model is not None:
                    break
                try:
                    page = await server.client.models.list()
                except openai.APIError as exc:
                    failures.append(f"{server.url}: {exc.message}")
                    unreachable += is_unreachable(exc)
                    continue
                if not page.data:
                    failures.append(f"{server.url}/models lists no model")
                    continue
                self._model = page.data[0].id
                logger.info("using model %s served at %s", self._model, server.url)
            if self._model is None and unreachable == len(self._servers):  # a model name would not help
                raise OpenAIBackendError(
                    f"cannot reach any server ({'; '.join(failures)}): is one running at that URL (--base-url)?"
                )
            if self._model is None:
                raise OpenAIBackendError(
                    f"cannot find a model to use ({'; '.join(failures)}); name the served model (--served-model)"
                )
        return self._model

    async def _send(self, create: Callable[[openai.AsyncOpenAI], Awaitable[T]]) -> tuple[T, _Server]:
        """``create(client)`` on a server, with the retries and fail-over of the module doc; returns its result and
        the server, whose ``outstanding`` count the caller brings down when it is done with the response.

        A server that cannot be reached sends the request on to a server that is up and not yet tried by it at
        once, with no backoff and no retry spent (with [dead, dead, live], the first request reaches the live
        one); a retry, after its backoff, goes to another server than the one that just failed when there is one.
        """
        attempt = 0
        failed: _Server | None = None
        unreachable: list[_Server] = []  # servers this request could not reach
        while True:
            server = self._pick(avoid=[*unreachable, failed] if failed is not None else unreachable)
            server.outstanding += 1
            try:
                result = await create(server.client)
            except BaseException as exc:  # cancellation included: the count must come down
                server.outstanding -= 1
                if not isinstance(exc, openai.APIError):
                    raise
                failed = server
                if self._fail_over(exc, server, unreachable):
                    continue
                await self._after_failure(exc, server, attempt)
                attempt += 1
                continue
            server.down_until = 0.0
            return result, server

    def _fail_over(self, exc: openai.APIError, server: _Server, unreachable: list[_Server]) -> bool:
        """Whether a request that could not reach ``server`` goes on at once: some server is up that it has not
        tried (``server`` is marked down for ``cooldown`` seconds either way)."""
        if not is_unreachable(exc):
            return False
        server.down_until = time.monotonic() + self.cooldown
        unreachable.append(server)
        now = time.monotonic()
        return any(_is_up(s, now) and all(s is not u for u in unreachable) for s in self._servers)

    def _pick(self, avoid: Sequence[_Server] = ()) -> _Server:
        """The server with the fewest outstanding requests among those up (all, when none is) other than those in
        ``avoid`` (unless no other is left); among ties, the next one after the last pick. A server past its
        cooldown that has not answered since is up for one request at a time (a probe)."""
        now = time.monotonic()
        up = [s for s in self._servers if _is_up(s, now)]
        choices = up or self._servers
        choices = [s for s in choices if all(s is not a for a in avoid)] or choices
        fewest = min(s.outstanding for s in choices)
        count = len(self._servers)
        for step in range(count):
            index = (self._next + step) % count
            server = self._servers[index]
            if server.outstanding == fewest and any(server is s for s in choices):
                self._next = (index + 1) % count
                return server
        raise AssertionError("unreachable: some choice has the fewest requests")

    async def _after_failure(self, exc: openai.APIError, server: _Server, attempt: int) -> None:
        """Raise ``OpenAIBackendError`` if ``exc`` is final; otherwise mark an unreachable server down and wait out
        the backoff (or the server's Retry-After) before the retry."""
        status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
        if is_read_timeout(exc):
            raise OpenAIBackendError(
                f"{server.url} timed out reading the response (not retried: it would most likely time out again; "
                "raise the timeout for long generations)",
                None,
                server.url,
            ) from exc
        if not is_retryable(exc):
            raise OpenAIBackendError(f"{server.url} refused the request: {exc.message}", status, server.url) from exc
        if is_unreachable(exc) or (status is not None and status >= 500):  # a failing server (a 503 after its
            # engine failed answers at once, so with the fewest requests outstanding it drew most first attempts)
            server.down_until = time.monotonic() + self.cooldown
        if attempt >= self.max_retries:
            raise OpenAIBackendError(
                f"{server.url} failed after {attempt + 1} attempts: {exc.message}", status, server.url
            ) from exc
        delay = retry_after_seconds(exc)
        if delay is None:
            delay = backoff_seconds(attempt, self.backoff, self.max_backoff)
        logger.warning("%s: %s; retry %d/%d in %.2f s", server.url, exc.message, attempt + 1, self.max_retries, delay)
        await asyncio.sleep(delay)

    def _arguments(self, request: CompletionRequest, model: str, stream: bool) -> dict[str, Any]:
        logprobs = request.logprobs and not stream  # a stream is text only
        kwargs: dict[str, Any] = {
            "model": model,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.stop:
            kwargs["stop"] = list(request.stop)
        if request.seed is not None:
            kwargs["seed"] = request.seed
        if request.chat:
            kwargs["messages"] = [{"role": "user", "content": request.prompt}]
            if logprobs:
                kwargs["logprobs"] = True
        else:
            kwargs["prompt"] = request.prompt
            if logprobs:
                kwargs["logprobs"] = 0  # the sampled token's log-probability (no alternatives)
        if stream:
            kwargs["stream_options"] = {"include_usage": True}  # the Completion that ends a stream counts tokens
        extra: dict[str, Any] = {}  # vLLM's fields beyond OpenAI's API
        if request.top_k:
            extra["top_k"] = request.top_k
        if self.forward_priority:
            # the live value: a retry after the search took a speculative request over goes at its new priority
            extra["priority"] = request.priority if request.live_priority is None else request.live_priority.value
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    @staticmethod
    def _completion(response: Any, chat: bool, seconds: float, url: str) -> Completion:
        choice = response.choices[0]
        pairs: list[tuple[str | None, float]] = []  # (token text if given, logprob) per generated token
        if chat:
            text = choice.message.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                pairs = [(item.token, item.logprob) for item in choice.logprobs.content]
        else:
            text = choice.text
            if choice.logprobs is not None and choice.logprobs.token_logprobs:
                given = choice.logprobs.tokens or [None] * len(choice.logprobs.token_logprobs)
                pairs = [(t, lp) for t, lp in zip(given, choice.logprobs.token_logprobs) if lp is not None]
        tokens = [t for t, _ in pairs]
        usage = response.usage
        return Completion(
            text=text,
            finish_reason=finish_reason(choice.finish_reason, url),
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            logprobs=[lp for _, lp in pairs],
            tokens=tokens if all(isinstance(t, str) for t in tokens) else [],
            seconds=seconds,
        )


def _is_up(server: _Server, now: float) -> bool:
    """Up: never down, or past its cooldown with no request out (one probe at a time)."""
    return server.down_until <= now and (server.down_until == 0.0 or server.outstanding == 0)


def _text_api(client: openai.AsyncOpenAI) -> Any:
    return client.completions


def _chat_api(client: openai.AsyncOpenAI) -> Any:
    return client.chat.completions
