"""``OpenAIBackend`` over loopback against spectot's own server on a fake slow backend, and against tiny apps
that fail on purpose: load balancing, retries (503, 429, 408, connection refused; on another server, and none
to a server found down) and none on 400, a read timeout or an aborted generation, a host that never answers
costing the connect timeout only, cancellation reaching the server, streaming, parameters and model discovery."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Sequence

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from spectot.backends.base import Completion, CompletionRequest
from spectot.backends.openai import (
    MAX_RETRY_AFTER,
    OpenAIBackend,
    OpenAIBackendError,
    backoff_seconds,
    retry_after_seconds,
)
from spectot.server.app import BackgroundServer, create_app


class SlowBackend:
    """A fake served model: each word of the prompt echoed back after ``delay`` seconds, each request recorded."""

    name = "fake-model"
    max_context = 64

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.requests: list[CompletionRequest] = []
        self.live = 0
        self.cancelled = 0
        self.abandoned_streams = 0

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def render_chat(self, messages: Sequence[dict]) -> str:
        return " ".join(m["content"] for m in messages)

    def words(self, request: CompletionRequest) -> list[str]:
        return request.prompt.split()[: request.max_tokens]

    async def complete(self, request: CompletionRequest) -> Completion:
        self.requests.append(request)
        self.live += 1
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.live -= 1
        words = self.words(request)
        return Completion(
            " ".join(words),
            "length" if len(words) == request.max_tokens else "stop",
            prompt_tokens=self.count_tokens(request.prompt),
            completion_tokens=len(words),
            logprobs=[-1.0] * len(words) if request.logprobs else [],
            tokens=[w if i == 0 else " " + w for i, w in enumerate(words)] if request.logprobs else [],
        )

    async def stream(self, request: CompletionRequest):
        self.requests.append(request)
        finished = False
        try:
            for k, word in enumerate(self.words(request)):
                await asyncio.sleep(self.delay)
                yield word if k == 0 else " " + word
            finished = True
        finally:
            self.abandoned_streams += not finished

    def failure(self) -> str | None:
        return None

    async def aclose(self) -> None:
        pass


def scripted_app(statuses: list[int], calls: list[int]) -> FastAPI:
    """An app whose /v1/completions answers each call with the next status of ``statuses`` (the last one
    repeats): an OpenAI error body for 4xx / 5xx, a one-choice completion for 200."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        status = statuses[min(len(calls), len(statuses) - 1)]
        calls.append(status)
        if status != 200:
            error = {"message": f"scripted failure {status}", "type": "server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=status, headers={"retry-after": "0"})
        choice = {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        body = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}
        return JSONResponse({**body, "usage": usage})

    return app


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def quick(backend: OpenAIBackend) -> OpenAIBackend:
    backend.backoff = 0.01  # retries in milliseconds, not seconds
    return backend


REQUEST = CompletionRequest("a b c d", max_tokens=3, temperature=0.0)


def test_backoff_grows_and_is_capped() -> None:
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (6, 8.0)]:
        delays = [backoff_seconds(attempt, base=0.5, cap=8.0) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling / 2  # full jitter actually spreads up to the ceiling
    assert 0.0 <= backoff_seconds(1100, base=0.5, cap=8.0) <= 8.0  # 2**1100 overflowed a float (--retries is open)


def test_urls_get_v1_and_the_model_is_discovered() -> None:
    fake = SlowBackend()

    async def scenario(url: str) -> None:
        async with OpenAIBackend.from_urls([url], model=None, timeout=10, max_retries=0) as backend:
            assert backend.urls == [url + "/v1"]
            out = await backend.complete(REQUEST)
            assert backend.name == "fake-model"
            assert (out.text, out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("a b c", "length", 4, 3)
            assert out.seconds > 0

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario(server.url))


def test_a_url_that_is_none_is_refused_and_an_unreachable_one_named() -> None:
    """``notaurl`` was taken (every request then failed with a connection error), and a server that could not be
    reached was answered with advice to pass the model name."""
    for url in ("notaurl", "localhost:8000", "http://", "ftp://host/v1", "http://host:99999/v1"):
        with pytest.raises(ValueError, match=f"server URL {url}: "):
            OpenAIBackend.from_urls([url])
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> None:
        async with OpenAIBackend.from_urls([f"http://127.0.0.1:{port}"], timeout=5, max_retries=0) as backend:
            with pytest.raises(OpenAIBackendError, match=r"cannot reach any server .*is one running at that URL"):
                await backend.model()

    asyncio.run(scenario())


def test_parameters_reach_the_served_backend() -> None:
    fake = SlowBackend()
    request = CompletionRequest("a b c d", 2, temperature=0.7, top_p=0.9, stop=("x", "y"), seed=11, logprobs=True)

    async def scenario(url: str) -> None:
        async with OpenAIBackend.from_urls([url], model="fake-model", timeout=10, max_retries=0) as backend:
            out = await backend.complete(request)
            assert out.logprobs == [-1.0, -1.0] and out.tokens == ["a", " b"]
            chat = await backend.complete(CompletionRequest("hi there", 5, seed=3, chat=True, logprobs=True))
            assert (chat.text, chat.finish_reason, chat.logprobs) == ("hi there", "stop", [-1.0, -1.0])
            assert chat.tokens == ["hi", " there"]
            await backend.complete(CompletionRequest("a b", 2, temperature=0.5, seed=1, top_k=7))  # vLLM's extra field
            assert backend.failure() is None  # a failing server is retried or skipped, never the backend's end

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario(server.url))
    plain, chat, top_k = fake.requests
    assert plain == CompletionRequest("a b c d", 2, 0.7, 0.9, ("x", "y"), 11, logprobs=True)
    assert chat == CompletionRequest("hi there", 5, 0.0, 1.0, (), 3, logprobs=True, chat=True)
    assert top_k == CompletionRequest("a b", 2, 0.5, seed=1, top_k=7)


def test_requests_spread_over_two_servers() -> None:
    fakes = [SlowBackend(delay=0.3), SlowBackend(delay=0.3)]

    async def scenario(urls: list[str]) -> None:
        async with OpenAIBackend.from_urls(urls, model="fake-model", timeout=10, max_retries=0) as backend:
            task = asyncio.gather(*[backend.complete(REQUEST) for _ in range(6)])
            await wait_until(lambda: sum(f.live for f in fakes) == 6)
            assert [f.live for f in fakes] == [3, 3]  # the fewest outstanding first
            assert backend.outstanding() == [3, 3]
            assert [o.text for o in await task] == ["a b c"] * 6
            for fake in fakes:
                fake.delay = 0.0
            for _ in range(4):  # one at a time: every server ties at 0, so round-robin
                await backend.complete(REQUEST)
            assert backend.outstanding() == [0, 0]

    with BackgroundServer(create_app(fakes[0])) as a, BackgroundServer(create_app(fakes[1])) as b:
        asyncio.run(scenario([a.url, b.url]))
    assert [len(f.requests) for f in fakes] == [5, 5]


@pytest.mark.parametrize("status", [503, 429, 500, 408])
def test_a_transient_failure_is_retried(status) -> None:
    calls: list[int] = []

    async def scenario(url: str) -> Completion:
        async with quick(OpenAIBackend.from_urls([url], model="m", timeout=10, max_retries=2)) as backend:
            return await backend.complete(REQUEST)

    with BackgroundServer(scripted_app([status, 200], calls)) as server:
        out = asyncio.run(scenario(server.url))
    assert out.text == "ok"
    assert calls == [status, 200]


def test_retries_give_up_with_the_last_error() -> None:
    calls: list[int] = []

    async def scenario(url: str) -> None:
        async with quick(OpenAIBackend.from_urls([url], model="m", timeout=10, max_retries=2)) as backend:
            with pytest.raises(OpenAIBackendError, match="failed after 3 attempts.*scripted failure 503") as err:
                await backend.complete(REQUEST)
            assert err.value.status == 503

    with BackgroundServer(scripted_app([503], calls)) as server:
        asyncio.run(scenario(server.url))
    assert calls == [503, 503, 503]


def test_a_bad_request_is_not_retried_and_its_message_surfaces() -> None:
    calls: list[int] = []

    async def scenario(url: str) -> None:
        async with quick(OpenAIBackend.from_urls([url], model="m", timeout=10, max_retries=3)) as backend:
            with pytest.raises(OpenAIBackendError, match="refused the request.*scripted failure 400") as err:
                await backend.complete(REQUEST)
            assert err.value.status == 400

    with BackgroundServer(scripted_app([400, 200], calls)) as server:
        asyncio.run(scenario(server.url))
    assert calls == [400]


def test_the_servers_own_validation_message_surfaces() -> None:
    fake = SlowBackend()

    async def scenario(url: str) -> None:
        async with quick(OpenAIBackend.from_urls([url], model="fake-model", timeout=10, max_retries=3)) as backend:
            with pytest.raises(OpenAIBackendError, match="maximum context length is 64 tokens"):
                await backend.complete(CompletionRequest("a " * 60, max_tokens=8))
        async with OpenAIBackend.from_urls([url], model="other", timeout=10, max_retries=3) as backend:
            with pytest.raises(OpenAIBackendError, match="The model `other` does not exist") as err:
                await backend.complete(REQUEST)
            assert err.value.status == 404

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario(server.url))
    assert fake.requests == []


def test_a_dead_server_is_skipped() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    fake = SlowBackend()

    async def scenario(url: str) -> None:
        async with quick(OpenAIBackend.from_urls([dead, url], model=None, timeout=10, max_retries=1)) as b:
            assert await b.model() == "fake-model"  # asked of the server that answers
            assert [(await b.complete(REQUEST)).text for _ in range(3)] == ["a b c"] * 3

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario(server.url))
    assert len(fake.requests) == 3


def test_cancelling_the_task_cancels_the_servers_generation() -> None:
    fake = SlowBackend(delay=30.0)

    async def scenario(url: str) -> None:
        async with OpenAIBackend.from_urls([url], model="fake-model", timeout=60, max_retries=0) as backend:
            task = asyncio.create_task(backend.complete(REQUEST))
            await wait_until(lambda: fake.live == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: fake.cancelled == 1)  # the server saw the connection close
            assert backend.outstanding() == [0]
            fake.delay = 0.0
            assert (await backend.complete(REQUEST)).text == "a b c"  # and the backend still works

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario(server.url))


def test_stream_pieces_and_closing_a_stream_early() -> None:
    fake = SlowBackend()

    async def scenario(url: str) -> None:
        async with OpenAIBackend.from_urls([url], model="fake-model", timeout=60, max_retries=0) as backend:
            *pieces, ending = [p async for p in backend.stream(REQUEST)]
            assert pieces == ["a", " b", " c"]
            assert isinstance(ending, Completion) and ending.text == "a b c"
            assert (ending.finish_reason, ending.prompt_tokens, ending.completion_tokens) == ("length", 4, 3)
            chat = CompletionRequest("x y", max_tokens=4, chat=True)
            *pieces, ending = [p async for p in backend.stream(chat)]
            assert "".join(pieces) == "x y" and (ending.finish_reason, ending.completion_tokens) == ("stop", 2)
            fake.delay = 0.3
            pieces = backend.stream(CompletionRequest("a b c d e f g h", max_tokens=8))
            assert await anext(pieces) == "a"
            await pieces.aclose()
            await wait_until(lambda: fake.abandoned_streams == 1)
            assert backend.outstanding() == [0]

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario(server.url))
    assert fake.requests[1].chat


def unused_url() -> str:
    """A localhost URL nobody listens on: connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_an_unreachable_server_passes_the_request_on_and_is_skipped_for_a_while() -> None:
    """With [dead, dead, live] and no retries, the first request goes on from each dead server to the next at
    once (no retry spent); from then on both are known down and every request goes to the live one."""
    fake = SlowBackend()

    async def scenario(urls: list[str]) -> None:
        async with OpenAIBackend.from_urls(urls, model="fake-model", timeout=10, max_retries=0) as backend:
            assert [(await backend.complete(REQUEST)).text for _ in range(3)] == ["a b c"] * 3
            *pieces, _ = [p async for p in backend.stream(REQUEST)]
            assert "".join(pieces) == "a b c"
            assert [s.down_until > time.monotonic() for s in backend._servers] == [True, True, False]

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario([unused_url(), unused_url(), server.url]))
    assert len(fake.requests) == 4

    async def all_dead(urls: list[str]) -> None:  # no server up: the failures are retried (and then raised)
        async with quick(OpenAIBackend.from_urls(urls, model="fake-model", timeout=10, max_retries=1)) as backend:
            with pytest.raises(OpenAIBackendError, match="failed after 2 attempts"):
                await backend.complete(REQUEST)

    asyncio.run(all_dead([unused_url(), unused_url()]))


def test_a_retry_goes_to_another_server() -> None:
    """The failing server has fewer requests outstanding than the busy live one, yet the retry goes elsewhere."""
    fake = SlowBackend(delay=0.5)
    calls: list[int] = []

    async def scenario(urls: list[str]) -> None:
        async with quick(OpenAIBackend.from_urls(urls, model="fake-model", timeout=10, max_retries=1)) as backend:
            busy = asyncio.create_task(backend.complete(REQUEST))  # to the live server: it comes first
            await wait_until(lambda: fake.live == 1)
            assert (await backend.complete(REQUEST)).text == "a b c"  # 503 there, then the live server
            assert (await busy).text == "a b c"

    with BackgroundServer(create_app(fake)) as live, BackgroundServer(scripted_app([503], calls)) as failing:
        asyncio.run(scenario([live.url, failing.url]))
    assert calls == [503]
    assert len(fake.requests) == 2


def test_a_server_answering_5xx_is_skipped_for_a_while() -> None:
    """A server whose engine failed answers 503 at once: with no request outstanding it tied for the pick, drew half
    the first attempts and cost each of them a retry (with max_retries 0, a failure)."""
    fake = SlowBackend()
    calls: list[int] = []

    async def scenario(urls: list[str]) -> None:
        async with quick(OpenAIBackend.from_urls(urls, model="fake-model", timeout=10, max_retries=1)) as backend:
            for _ in range(6):
                assert (await backend.complete(REQUEST)).text == "a b c"

    with BackgroundServer(scripted_app([503], calls)) as failing, BackgroundServer(create_app(fake)) as live:
        asyncio.run(scenario([failing.url, live.url]))
    assert calls == [503] and len(fake.requests) == 6  # once, then the live server's until the cooldown ends


def test_a_host_that_never_answers_costs_the_connect_timeout_only() -> None:
    """A listener whose backlog is full drops new connections unanswered (as a blackholed host does): the
    request moves on to the live server after ``connect_timeout``, not after the read ``timeout``."""
    fake = SlowBackend()
    with socket.socket() as blackhole, socket.socket() as filler:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(0)
        filler.connect(blackhole.getsockname())  # the one queued connection: later ones hang

        async def scenario(urls: list[str]) -> str:
            backend = OpenAIBackend.from_urls(urls, model="fake-model", timeout=60, max_retries=1, connect_timeout=0.2)
            async with quick(backend):
                return (await asyncio.wait_for(backend.complete(REQUEST), timeout=20)).text

        with BackgroundServer(create_app(fake)) as server:
            host, port = blackhole.getsockname()
            assert asyncio.run(scenario([f"http://{host}:{port}", server.url])) == "a b c"


def test_a_dropped_connection_is_retried_and_leaves_the_server_in_the_rotation() -> None:
    """A server that reads the request and hangs up (a reset, a crash mid-request) reached the server: the request is
    retried with backoff (on the other server) and the server is not benched for the cooldown as an unreachable
    one is (every connection error did that, moving all its load onto the others for 10 s)."""
    fake = SlowBackend()
    with socket.socket() as hangup:
        hangup.bind(("127.0.0.1", 0))
        hangup.listen(8)
        hangup.settimeout(10)
        host, port = hangup.getsockname()

        def hang_up_once() -> None:
            connection, _ = hangup.accept()
            connection.recv(65536)
            connection.close()

        async def scenario(urls: list[str]) -> list[float]:
            async with quick(OpenAIBackend.from_urls(urls, model="fake-model", timeout=10, max_retries=1)) as backend:
                closer = asyncio.create_task(asyncio.to_thread(hang_up_once))
                assert (await backend.complete(REQUEST)).text == "a b c"
                await closer
                return [s.down_until for s in backend._servers]

        with BackgroundServer(create_app(fake)) as server:
            assert asyncio.run(scenario([f"http://{host}:{port}", server.url])) == [0.0, 0.0]
    assert len(fake.requests) == 1


def test_a_server_past_its_cooldown_takes_one_probe_at_a_time() -> None:
    """A server marked down whose cooldown has passed and that has not answered since gets one request at a time,
    not every new request until its count matches the live servers' (a blackholed host cost each a connect
    timeout); once it answers it is a full member again."""
    backend = OpenAIBackend.from_urls(["http://127.0.0.1:9", "http://127.0.0.1:10"], model="m")
    dead, live = backend._servers
    live.outstanding = 5
    dead.down_until = time.monotonic() - 1.0  # cooldown over, no answer since
    assert backend._pick() is dead  # the probe
    dead.outstanding = 1
    assert all(backend._pick() is live for _ in range(3))
    dead.down_until = 0.0  # it answered
    assert backend._pick() is dead  # 1 outstanding against 5


def slow_app(seconds: float, calls: list[int]) -> FastAPI:
    """An app whose /v1/completions takes ``seconds`` before it answers."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        calls.append(200)
        await asyncio.sleep(seconds)
        return JSONResponse({})

    return app


def test_a_read_timeout_is_not_retried() -> None:
    """The request waited the whole timeout: a retry would most likely wait it out again."""
    calls: list[int] = []

    async def scenario(url: str) -> None:
        async with quick(OpenAIBackend.from_urls([url], model="m", timeout=0.3, max_retries=3)) as backend:
            with pytest.raises(OpenAIBackendError, match="timed out reading"):
                await backend.complete(REQUEST)

    with BackgroundServer(slow_app(1.0, calls)) as server:
        asyncio.run(scenario(server.url))
    assert calls == [200]


def aborting_app() -> FastAPI:
    """An app whose generations end with vLLM's finish reason "abort", streamed or not."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m"}
        if (await request.json()).get("stream"):
            pieces = [("par", None), ("", "abort")]
            events = [
                {**head, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": r}]} for t, r in pieces
            ]
            body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return StreamingResponse(iter([body]), media_type="text/event-stream")
        choice = {"index": 0, "text": "par", "logprobs": None, "finish_reason": "abort"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return JSONResponse({**head, "choices": [choice], "usage": usage})

    return app


def test_an_aborted_generation_is_an_error_not_a_finished_text() -> None:
    pieces: list[str] = []

    async def scenario(url: str) -> None:
        async with OpenAIBackend.from_urls([url], model="m", timeout=10, max_retries=0) as backend:
            with pytest.raises(OpenAIBackendError, match="aborted the generation"):
                await backend.complete(REQUEST)
            with pytest.raises(OpenAIBackendError, match="aborted the generation"):
                async for piece in backend.stream(REQUEST):
                    pieces.append(piece)

    with BackgroundServer(aborting_app()) as server:
        asyncio.run(scenario(server.url))
    assert pieces == ["par"]


def test_a_stream_that_ends_without_a_finish_reason_is_an_error() -> None:
    """A body that ends cleanly mid-generation (no finish reason, no [DONE]: a proxy gave up upstream) was a
    finished "stop" completion of the partial text."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        event = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        event["choices"] = [{"index": 0, "text": "hel", "logprobs": None, "finish_reason": None}]
        return StreamingResponse(iter([f"data: {json.dumps(event)}\n\n"]), media_type="text/event-stream")

    pieces: list[str] = []

    async def scenario(url: str) -> None:
        async with OpenAIBackend.from_urls([url], model="m", timeout=10, max_retries=0) as backend:
            with pytest.raises(OpenAIBackendError, match="ended without a finish reason"):
                async for piece in backend.stream(REQUEST):
                    pieces.append(piece)

    with BackgroundServer(app) as server:
        asyncio.run(scenario(server.url))
    assert pieces == ["hel"]


def test_fail_over_waits_for_a_server_whose_probe_is_out() -> None:
    """Past its cooldown a server takes one request at a time (a probe); fail-over counted it as up while its
    probe was out, and the request went there as a second probe (the full connect timeout on a silent host)."""
    import time

    backend = OpenAIBackend.from_urls(["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"], model="m")
    tried, probing = backend._servers
    probing.down_until, probing.outstanding = time.monotonic() - 1, 1
    refused = openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1/completions"))
    refused.__cause__ = httpx.ConnectError("refused")
    assert not backend._fail_over(refused, tried, [])
    probing.outstanding = 0
    tried.down_until = 0.0
    assert backend._fail_over(refused, tried, [])


def status_error(status: int, headers: dict[str, str]) -> openai.APIStatusError:
    response = httpx.Response(status, headers=headers, request=httpx.Request("POST", "http://x/v1/completions"))
    return openai.APIStatusError("scripted", response=response, body=None)


def test_retry_after_is_read_on_429_and_503_only() -> None:
    assert retry_after_seconds(status_error(503, {"retry-after": "2"})) == 2.0
    assert retry_after_seconds(status_error(429, {"Retry-After": "0.5"})) == 0.5
    assert retry_after_seconds(status_error(429, {"retry-after": "86400"})) == MAX_RETRY_AFTER
    assert retry_after_seconds(status_error(503, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None
    assert retry_after_seconds(status_error(503, {"retry-after": "nan"})) is None
    assert retry_after_seconds(status_error(503, {})) is None
    assert retry_after_seconds(status_error(500, {"retry-after": "2"})) is None


def test_a_forwarded_priority_is_the_live_one() -> None:
    """A retry of a speculative request the search had taken over went out at its old priority."""
    from spectot.backends.base import LivePriority

    backend = OpenAIBackend.from_urls(["http://localhost:1"])
    backend.forward_priority = True
    live = LivePriority(2)
    request = CompletionRequest("a", 4, priority=2, live_priority=live)
    live.set(0)
    assert backend._arguments(request, "m", stream=False)["extra_body"]["priority"] == 0
