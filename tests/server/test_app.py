"""The OpenAI-compatible server: request validation and error bodies, the streaming format and n > 1 over a
fake backend, health, the body limit, tokenising once off the event loop, and shutdown (requests cut with a 503,
SIGTERM closing the backend); then end to end over loopback on a tiny random Llama behind ``LocalEngineBackend``
with the official ``openai`` client (greedy text == the Pipeline's, ``OpenAIBackend`` agrees, cancellation is
harmless, a failed engine step turns /health to 503), and a stress test of 16 concurrent clients."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from spectot.backends.base import Completion, CompletionRequest
from spectot.server.app import SHUTTING_DOWN, BackgroundServer, create_app
from spectot.spec.decoding import stream_seeds


class FakeBackend:
    """Tokenizer-free and deterministic: a token is a word; request (prompt, seed, max_tokens) completes to
    the words 's{seed}t0 s{seed}t1 ...', at most ``natural_length`` of them ("stop" when it ends early)."""

    name = "fake-model"
    max_context = 32
    natural_length = 5

    def __init__(self, delay: float = 0.0, error: Exception | None = None) -> None:
        self.delay = delay  # seconds per completion / per streamed word
        self.error = error  # raised by every generation (after its delay)
        self.requests: list[CompletionRequest] = []
        self.live = 0
        self.max_live = 0
        self.cancelled = 0  # completions whose task was cancelled
        self.abandoned_streams = 0  # streams closed before their last word
        self.failed: str | None = None  # what ``failure()`` says

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def render_chat(self, messages: Sequence[dict]) -> str:
        return " ".join(f"[{m['role']}] {m['content']}" for m in messages) + " [assistant]"

    def words(self, request: CompletionRequest) -> list[str]:
        return [f"s{request.seed}t{k}" for k in range(min(request.max_tokens, self.natural_length))]

    async def complete(self, request: CompletionRequest) -> Completion:
        self.requests.append(request)
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.live -= 1
        if self.error is not None:
            raise self.error
        words = self.words(request)
        return Completion(
            text=" ".join(words),
            finish_reason="length" if len(words) == request.max_tokens else "stop",
            prompt_tokens=self.count_tokens(request.prompt),
            completion_tokens=len(words),
            logprobs=[-0.5] * len(words) if request.logprobs else [],
            tokens=[("" if k == 0 else " ") + w for k, w in enumerate(words)] if request.logprobs else [],
        )

    async def stream(self, request: CompletionRequest):
        self.requests.append(request)
        words = self.words(request)
        finished = False
        try:
            for k, word in enumerate(words):
                await asyncio.sleep(self.delay)
                if self.error is not None:
                    raise self.error
                yield word if k == 0 else " " + word
            finished = True
        finally:
            self.abandoned_streams += not finished

    def failure(self) -> str | None:
        return self.failed

    async def aclose(self) -> None:
        pass


class TemplatelessBackend(FakeBackend):
    """A backend that cannot render a conversation (no ``render_chat``), like ``OpenAIBackend``."""

    render_chat = None  # type: ignore[assignment]


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(fake) -> TestClient:
    return TestClient(create_app(fake))


def sse_events(lines: Sequence[str]) -> list[dict]:
    """The JSON events of a server-sent-event stream, checking its framing and the final [DONE]."""
    data = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in data), data
    assert data[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in data[:-1]]


def stream_lines(client: TestClient, path: str, body: dict) -> list[str]:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(response.iter_lines())


# -- plain requests ----------------------------------------------------------------------------------------------
def test_models_lists_the_backend(client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake-model"]
    assert body["data"][0]["max_model_len"] == 32
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"  # the client's models.retrieve
    missing = client.get("/v1/models/org/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_stream_options_need_stream(client) -> None:
    body = {"prompt": "a", "max_tokens": 1, "stream_options": {"include_usage": True}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and "only allowed when stream is true" in response.json()["error"]["message"]


def test_completion_fields_and_usage(client, fake) -> None:
    response = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "a b c", "max_tokens": 3, "seed": 4}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "s4t0 s4t1 s4t2", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    (request,) = fake.requests
    assert (request.prompt, request.max_tokens, request.seed, request.chat) == ("a b c", 3, 4, False)
    assert (request.temperature, request.top_p, request.stop) == (1.0, 1.0, ())


def test_sampling_parameters_reach_the_backend(client, fake) -> None:
    body = {"prompt": "a", "max_tokens": 9, "temperature": 0, "top_p": 0.5, "stop": ["x", "y"], "seed": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    client.post("/v1/completions", json={"prompt": "a", "stop": "z"})
    first, second = fake.requests
    assert (first.max_tokens, first.temperature, first.top_p, first.stop, first.seed) == (9, 0.0, 0.5, ("x", "y"), 1)
    assert second.stop == ("z",)
    assert second.seed is None
    assert second.max_tokens == 16  # no max_tokens: OpenAI's and vLLM's 16 (it filled the 32-token context)
    chat = {"messages": [{"role": "user", "content": "a"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert fake.requests[-1].max_tokens == 32 - 3  # chat: the rest of the context ("[user] a [assistant]")
    client.post("/v1/completions", json={"prompt": " ".join(["a"] * 28)})
    assert fake.requests[-1].max_tokens == 4  # 16 where the context has room, else what it has


def test_n_choices_get_seeds_hashed_from_the_seed(client, fake) -> None:
    """Choice 0 takes the seed itself, choice j a hash of (seed, j): consecutive seeds share no sample (with
    seed + j, seeds 100 and 101 shared 3 of 4)."""
    body = client.post("/v1/completions", json={"prompt": "a b", "n": 3, "seed": 7, "max_tokens": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    seeds = [7, *stream_seeds(7, "choice", n=2, first=1)]
    assert [r.seed for r in fake.requests] == seeds
    assert [c["text"] for c in body["choices"]] == [f"s{s}t0 s{s}t1" for s in seeds]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}  # the prompt once
    texts = {}
    for seed in (100, 101):
        body = client.post("/v1/completions", json={"prompt": "a", "n": 4, "seed": seed, "max_tokens": 1}).json()
        texts[seed] = {c["text"] for c in body["choices"]}
        assert len(texts[seed]) == 4
    assert not texts[100] & texts[101]


def test_a_batch_of_prompts_times_n(client, fake) -> None:
    body = client.post("/v1/completions", json={"prompt": ["a b", "c"], "n": 2, "seed": 0, "max_tokens": 1}).json()
    second = stream_seeds(0, "choice", n=1, first=1)[0]
    assert [c["text"] for c in body["choices"]] == ["s0t0", f"s{second}t0", "s0t0", f"s{second}t0"]
    assert [r.prompt for r in fake.requests] == ["a b", "a b", "c", "c"]
    assert body["usage"]["prompt_tokens"] == 3


def test_too_many_choices_are_refused_before_any_work(fake) -> None:
    client = TestClient(create_app(fake, max_choices=4))
    response = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "asks for 6 completions (3 prompt(s) x n = 2)" in error["message"] and error["param"] == "prompt"
    response = client.post("/v1/chat/completions", json={"messages": USER, "n": 5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert fake.requests == []
    assert client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1}).status_code == 200


def test_choices_run_concurrently() -> None:
    fake = FakeBackend(delay=0.2)
    body = TestClient(create_app(fake)).post("/v1/completions", json={"prompt": "a", "n": 4}).json()
    assert len(body["choices"]) == 4
    assert fake.max_live == 4


def test_logprobs(client) -> None:
    for asked in ({"logprobs": 0}, {"logprobs": 1, "temperature": 0}):  # 1: the likeliest token is the sampled one
        body = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, **asked}).json()
        logprobs = body["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"] == [-0.5, -0.5]
        # one entry a token (it was null: clients indexing top_logprobs[i] failed), the sampled token's own
        assert logprobs["top_logprobs"] == [{t: -0.5} for t in logprobs["tokens"]]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}
    body = client.post("/v1/chat/completions", json=chat).json()
    assert [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]] == [-0.5] * 3


def test_chat_completion(client, fake) -> None:
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2, "seed": 3}
    body = client.post("/v1/chat/completions", json=chat).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "s3t0 s3t1"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert fake.requests[-1].chat and fake.requests[-1].prompt == "hi there"  # the backend applies its template


def test_a_conversation_is_rendered_with_the_chat_template(client, fake) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2}).json()
    assert body["usage"]["completion_tokens"] == 2
    (request,) = fake.requests
    assert not request.chat
    assert request.prompt == "[system] be brief [user] hi\nthere [assistant]"  # text parts joined as vLLM joins them
    assert request.max_tokens == 2


def test_a_conversation_is_fed_as_the_templates_own_ids() -> None:
    """A conversation's rendered text was tokenised anew, which added the BOS a tokenizer adds to plain text where
    the template writes none (Zephyr-style templates): the model got another prompt than vLLM feeds it."""

    class Tokenising(FakeBackend):
        def prompt_ids(self, prompt: str, chat: bool) -> list[int]:  # plain text: a BOS, then a word per id
            return [1] + [10 + len(w) for w in prompt.split()]

        def render_ids(self, messages) -> list[int]:  # the template's own ids: no BOS
            return [10 + len(w) for w in self.render_chat(messages).split()]

    fake = Tokenising()
    client = TestClient(create_app(fake))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()
    (request,) = fake.requests
    assert request.prompt_ids == tuple(fake.render_ids(messages)) and request.prompt_ids[0] != 1
    assert body["usage"]["prompt_tokens"] == len(request.prompt_ids)


def test_a_developer_message_is_a_system_message_to_the_template(client, fake) -> None:
    """'developer' (OpenAI's newer name for 'system') reached the template as is: templates that render only the
    roles they know dropped the instructions."""
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert fake.requests[0].prompt == "[system] be brief [user] hi [assistant]"


def test_backend_without_a_chat_template_takes_one_user_message() -> None:
    client = TestClient(create_app(TemplatelessBackend()))
    one = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=one).status_code == 200
    two = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=two)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "single user message" in response.json()["error"]["message"]


# -- bad requests ------------------------------------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]
LONG = " ".join(["w"] * 30)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("completions", {"max_tokens": 3}, 400, "prompt", "Field required"),
        ("completions", {"prompt": 5}, 400, "prompt", "a prompt is a string or a list of strings"),
        ("completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
        ("completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
        ("completions", {"prompt": "a", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
        ("completions", {"prompt": "a", "top_p": 0}, 400, "top_p", "greater than 0"),
        ("completions", {"prompt": "a", "n": 0}, 400, "n", "greater than or equal to 1"),
        ("completions", {"prompt": "a", "stop": [1]}, 400, "stop", "valid string"),
        ("completions", {"prompt": "a", "stop": [""]}, 400, "stop", "at least 1 character"),
        ("completions", {"prompt": "a", "stop": ["x", ""]}, 400, "stop", "at least 1 character"),
        ("completions", {"prompt": "a", "stop": ""}, 400, "stop", "at least 1 character"),
        ("completions", {"prompt": ""}, 400, "prompt", "the prompt is empty"),
        ("completions", {"prompt": ["a", ""]}, 400, "prompt", "prompt 1 is empty"),
        ("completions", {"prompt": []}, 400, "prompt", "an empty list holds no prompt"),
        ("completions", {"prompt": "a", "seed": 2**64}, 400, "seed", "less than or equal to 9223372036854775807"),
        ("completions", {"prompt": "a", "seed": -(2**63) - 1}, 400, "seed", "greater than or equal to"),
        ("completions", {"prompt": "a", "stop": ["x"] * 17}, 400, "stop", "at most 16 stop strings"),
        ("completions", {"prompt": "a", "stop": "x" * 513}, 400, "stop", "at most 512 characters, got one of 513"),
        ("completions", {"prompt": "a", "stop": ["x", "y" * 600]}, 400, "stop", "at most 512 characters"),
        ("completions", {"prompt": ["a", " "]}, 400, "prompt", "prompt 1 has no tokens"),
        ("chat/completions", {"messages": USER, "stop": ["s"] * 20}, 400, "stop", "at most 16 stop strings"),
        ("completions", {"prompt": "a", "top_k": -2}, 400, "top_k", "greater than or equal to -1"),
        ("completions", {"prompt": None}, 400, "prompt", "a prompt is a string or a list of strings"),
        # OpenAI's token-id prompts got one validator error per id of every member of the union
        ("completions", {"prompt": [1, 2]}, 400, "prompt", "prompt: token-id prompts are not supported"),
        ("completions", {"prompt": [[1, 2], [3]]}, 400, "prompt", "prompt: token-id prompts are not supported"),
        ("completions", {"prompt": ["a", 1]}, 400, "prompt", "prompt: a prompt is a string or a list of strings"),
        ("completions", {"prompt": "a", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
        ("completions", {"prompt": LONG, "max_tokens": 8}, 400, "prompt", "maximum context length is 32 tokens"),
        ("completions", {"prompt": LONG + " " + LONG}, 400, "prompt", "maximum context length is 32 tokens"),
        ("completions", {"prompt": "a", "best_of": 2}, 400, "best_of", "best_of > 1 is not supported"),
        ("completions", {"prompt": "a", "echo": True}, 400, "echo", "echo is not supported"),
        ("completions", {"prompt": "a", "suffix": "z"}, 400, "suffix", "suffix is not supported"),
        ("completions", {"prompt": "a", "logprobs": 3}, 400, "logprobs", "logprobs > 1 is not supported"),
        ("completions", {"prompt": "a", "logprobs": 1, "stream": True}, 400, "logprobs", "when streaming"),
        ("completions", {"prompt": "a", "logprobs": 1}, 400, "logprobs", "only supported with greedy decoding"),
        ("completions", {"prompt": "a", "best_of": 1, "n": 3}, 400, "best_of", "best_of must be at least n (3)"),
        ("completions", {"prompt": "a", "response_format": {"type": "json_object"}}, 400, "response_format", "text"),
        # vLLM's chat fields that change the prompt the model is fed were ignored
        ("chat/completions", {"messages": USER, "continue_final_message": True}, 400, "continue_final_message", ""),
        ("chat/completions", {"messages": USER, "add_generation_prompt": False}, 400, "add_generation_prompt", ""),
        ("chat/completions", {"messages": USER, "chat_template_kwargs": {"x": 1}}, 400, "chat_template_kwargs", ""),
        ("chat/completions", {"messages": USER, "echo": True}, 400, "echo", "not supported"),
        ("chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
        ("chat/completions", {"messages": USER, "tool_choice": "required"}, 400, "tool_choice", "not supported"),
        ("completions", {"prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
        ("chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
        ("chat/completions", {"prompt": "hi"}, 400, "messages", "Field required"),
        (
            "chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages",
            "messages.0.role: Input should be 'system'",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages",
            "messages.0.content",
        ),
        ("chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
        ("chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "not supported"),
        ("chat/completions", {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
        ("chat/completions", {"messages": USER, "model": "x"}, 404, "model", "does not exist"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": LONG}], "max_tokens": 8},
            400,
            "messages",
            "maximum context length",
        ),
    ],
)
def test_bad_requests_get_openai_error_bodies(client, fake, path, body, status, param, message) -> None:
    response = client.post(f"/v1/{path}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message.replace(">= 1", "greater than or equal to 1") in error["message"]
    assert fake.requests == []  # nothing reached the backend


@pytest.mark.parametrize(
    "path, body, where",
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "w1 \ud800"}]}, "messages.0.content"),
        ("completions", {"prompt": "a", "model": "x\ud800"}, "model"),
        ("completions", {"prompt": ["a", "\udfff b"]}, "prompt.1"),
    ],
)
def test_a_lone_surrogate_is_a_400(client, fake, path, body, where) -> None:
    """JSON's "\\ud800" escape parses to a string no tokenizer can encode (nor the 404's message naming a model):
    the answer was a plain-text 500."""
    raw = json.dumps(body).encode()  # ASCII escapes, as a client sends them
    response = client.post(f"/v1/{path}", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert f"{where} is not valid Unicode text" in response.json()["error"]["message"]
    assert fake.requests == []


def test_a_body_that_is_not_json_says_so(client) -> None:
    response = client.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        '{"prompt":"a","temperature":Infinity}',
        '{"prompt":"a","top_p":NaN}',
        '{"prompt":"a","seed":0,"frequency_penalty":-Infinity}',
        '{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
    ],
)
def test_non_finite_numbers_are_refused(client, fake, raw) -> None:
    """Python's JSON parser reads Infinity and NaN; they are no sampling parameters."""
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
    response = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "finite number" in response.json()["error"]["message"]
    assert fake.requests == []


def test_null_means_the_default(client, fake) -> None:
    """The official client sends explicit nulls for parameters left unset: each means the field's default."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "seed"])
    response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "echo": None, **nulls})
    assert response.status_code == 200, response.text
    chat = {"messages": USER, "max_tokens": 2, "logprobs": None, "stream_options": None, **nulls}
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None
    for request in fake.requests:
        assert (request.temperature, request.top_p, request.seed) == (1.0, 1.0, None)
    assert len(fake.requests) == 2  # n: 1, stream: false


def test_the_extreme_seeds_are_taken(client, fake) -> None:
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": "a", "max_tokens": 1, "seed": seed, "n": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert [r.seed for r in fake.requests][::2] == [2**63 - 1, -(2**63)]
    assert all(0 <= r.seed < 2**62 for r in fake.requests[1::2])


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 1.3), ("min_tokens", 3), ("ignore_eos", True), ("min_p", 0.1), ("use_beam_search", True)],
)
def test_vllm_sampling_fields_the_engine_cannot_honour_are_refused(client, fake, field, value) -> None:
    for path, body in [("completions", {"prompt": "a"}), ("chat/completions", {"messages": USER})]:
        response = client.post(f"/v1/{path}", json={**body, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (field, "unsupported_parameter")
        assert f"{field} is not supported" in error["message"]
    assert fake.requests == []


def test_vllm_sampling_fields_at_their_no_op_values_are_taken(client, fake) -> None:
    no_ops = {"repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False, "min_p": 0, "stop_token_ids": []}
    response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, **no_ops, "user": "x"})
    assert response.status_code == 200, response.text
    response = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "repetition_penalty": None})
    assert response.status_code == 200, response.text


def test_top_k_reaches_the_backend(client, fake) -> None:
    for top_k in (5, -1, 0):
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "top_k": top_k}).status_code == 200
    assert [r.top_k for r in fake.requests] == [5, 0, 0]  # vLLM's -1 is off, as 0


def test_a_tiny_temperature_is_greedy(client, fake) -> None:
    """1 / 1e-45 overflows the logits to NaN; below 1e-5 (vLLM's threshold) the request is greedy."""
    for temperature in (1e-45, 9e-6, 1e-5):
        body = {"prompt": "a", "max_tokens": 1, "temperature": temperature, "seed": 1}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert [r.temperature for r in fake.requests] == [0.0, 0.0, 1e-5]


def test_a_request_the_backend_finds_at_fault_is_a_400() -> None:
    """A ValueError from the backend (the engine refusing a prompt) is the request's fault, streamed or not."""
    client = TestClient(create_app(FakeBackend(error=ValueError("prompt 0 has no tokens"))))
    response = client.post("/v1/completions", json={"prompt": "a"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["message"] == "prompt 0 has no tokens"
    events = sse_events(stream_lines(client, "/v1/completions", {"prompt": "a", "stream": True}))
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert events[-1]["error"]["message"] == "prompt 0 has no tokens"


def test_an_upstream_servers_4xx_is_passed_on() -> None:
    """Behind a remote backend, a request the upstream server refuses keeps its status, not a 500."""
    from spectot.backends.openai import OpenAIBackendError

    refused = OpenAIBackendError(
        "http://upstream/v1 refused the request (422): bad logit_bias", 422, "http://upstream/v1"
    )
    client = TestClient(create_app(FakeBackend(error=refused)))
    response = client.post("/v1/completions", json={"prompt": "a"})
    assert response.status_code == 422
    assert "bad logit_bias" in response.json()["error"]["message"]
    unreachable = OpenAIBackendError("no server answered", None, "")
    assert (
        TestClient(create_app(FakeBackend(error=unreachable))).post("/v1/completions", json={"prompt": "a"}).status_code
        == 500
    )


def test_context_and_unsupported_errors_have_codes(client) -> None:
    error = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 8}).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "38 tokens (30 in the prompt, 8 in the completion)" in error["message"]
    assert client.post("/v1/completions", json={"prompt": "a", "model": "m"}).json()["error"]["code"] == (
        "model_not_found"
    )
    assert client.post("/v1/completions", json={"prompt": "a", "echo": True}).json()["error"]["code"] == (
        "unsupported_parameter"
    )


def test_an_unexpected_error_is_a_500_with_an_error_body() -> None:
    """A bug in the server or a backend (a tokenizer raising on a text) still answers with OpenAI's body, not a
    plain-text 'Internal Server Error' a client cannot read."""

    class Broken(FakeBackend):
        def count_tokens(self, text: str) -> int:
            raise TypeError("the tokenizer cannot read this")

    client = TestClient(create_app(Broken()), raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"prompt": "a"})
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "internal error: TypeError",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def test_malformed_json_and_unknown_routes(client) -> None:
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None  # was "1", the character offset
    assert error["message"].startswith("the body is not valid JSON (character 1): ")
    response = client.post("/v1/edits", json={})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found"


def test_backend_failure_is_a_500_with_an_error_body() -> None:
    client = TestClient(create_app(FakeBackend(error=RuntimeError("the engine fell over"))))
    response = client.post("/v1/completions", json={"prompt": "a"})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "the engine fell over" in response.json()["error"]["message"]
    events = sse_events(stream_lines(client, "/v1/completions", {"prompt": "a", "stream": True}))
    assert "the engine fell over" in events[-1]["error"]["message"]


# -- streaming ---------------------------------------------------------------------------------------------------
def test_streamed_completion_format(client) -> None:
    body = {"prompt": "a b", "max_tokens": 3, "seed": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(stream_lines(client, "/v1/completions", body))
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    assert all(e["object"] == "text_completion" and e["model"] == "fake-model" for e in events)
    pieces = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(p["text"] for p in pieces) == "s2t0 s2t1 s2t2"
    assert [p["finish_reason"] for p in pieces] == [None, None, None, "length"]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_streamed_chat_format(client) -> None:
    body = {"messages": USER, "max_tokens": 10, "seed": 0, "stream": True}
    events = sse_events(stream_lines(client, "/v1/chat/completions", body))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "s0t0 s0t1 s0t2 s0t3 s0t4"
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


class EndingBackend(FakeBackend):
    """Streams end with their ``Completion``, whose counts and reason a backend knows better than the text."""

    async def stream(self, request: CompletionRequest):
        async for piece in super().stream(request):
            yield piece
        text = " ".join(self.words(request))
        yield Completion(text, "stop", prompt_tokens=1, completion_tokens=7)


def test_a_streamed_choice_ends_as_its_completion_says() -> None:
    """Re-derived from the text, 3 words of max_tokens 3 would be 'length' and 3 tokens."""
    client = TestClient(create_app(EndingBackend()))
    body = {"prompt": "a b", "max_tokens": 3, "seed": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(stream_lines(client, "/v1/completions", body))
    pieces = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(p["text"] for p in pieces) == "s2t0 s2t1 s2t2"
    assert [p["finish_reason"] for p in pieces] == [None, None, None, "stop"]
    assert events[-1]["usage"]["completion_tokens"] == 7
    assert events[-1]["usage"]["prompt_tokens"] == 1  # the Completion's (an upstream's behind a proxy), not counted


def test_streamed_n_choices(client) -> None:
    body = {"prompt": "a", "n": 2, "seed": 5, "max_tokens": 2, "stream": True}
    events = sse_events(stream_lines(client, "/v1/completions", body))
    texts, endings = ["", ""], [None, None]
    for event in events:
        (choice,) = event["choices"]
        assert endings[choice["index"]] is None  # nothing after a choice's last chunk
        texts[choice["index"]] += choice["text"]
        endings[choice["index"]] = choice["finish_reason"]
    second = stream_seeds(5, "choice", n=1, first=1)[0]
    assert texts == ["s5t0 s5t1", f"s{second}t0 s{second}t1"]
    assert endings == ["length", "length"]


# -- client disconnects, over loopback ---------------------------------------------------------------------------
async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_disconnect_cancels_the_generation() -> None:
    fake = FakeBackend(delay=30.0)

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            call = asyncio.create_task(http.post("/v1/completions", json={"prompt": "a", "n": 2}))
            await wait_until(lambda: fake.live == 2)
            call.cancel()
            await wait_until(lambda: fake.cancelled == 2)
            fake.delay = 0.5
            async with http.stream("POST", "/v1/completions", json={"prompt": "a", "stream": True}) as response:
                async for line in response.aiter_lines():
                    assert line.startswith("data: ")
                    break
            await wait_until(lambda: fake.abandoned_streams == 1)

    with BackgroundServer(create_app(fake)) as server:
        asyncio.run(scenario(server.url))
    assert fake.live == 0


# -- health, body size, tokenising, shutdown -------------------------------------------------------------------
def test_health_is_a_503_naming_the_failure_once_the_backend_cannot_serve(client, fake) -> None:
    assert client.get("/health").status_code == 200
    fake.failed = "the engine stopped after a failed step: RuntimeError('CUDA error')"
    response = client.get("/health")
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "service_unavailable"
    assert "CUDA error" in error["message"]
    response = client.post("/v1/completions", json={"prompt": "a"})  # not a 500 per request
    assert response.status_code == 503 and "CUDA error" in response.json()["error"]["message"]
    assert fake.requests == []


def test_a_body_over_the_limit_is_a_413(fake) -> None:
    client = TestClient(create_app(fake, max_body_mb=1 / 1024))  # 1 KiB
    assert client.post("/v1/completions", json={"prompt": "a" * 900, "max_tokens": 1}).status_code == 200
    response = client.post("/v1/completions", json={"prompt": "a" * 1100})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "0.000976562 MB" in error["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * 100
        yield b'{"prompt": "a"}'

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert len(fake.requests) == 1


class TokenisingBackend(FakeBackend):
    """Offers ``prompt_ids`` (one id per word), recording each call and whether an event loop ran on its thread."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenised: list[tuple[str, bool]] = []

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        self.tokenised.append((prompt, on_loop))
        return list(range(len(prompt.split())))


def test_each_prompt_is_tokenised_once_off_the_event_loop() -> None:
    """A prompt was tokenised on the event loop (a 6 MB one stalled every client for seconds), and again for each
    of its n choices; now once, on a worker thread, its ids reused by every choice."""
    backend = TokenisingBackend()
    client = TestClient(create_app(backend))
    body = client.post("/v1/completions", json={"prompt": ["a b c", "d"], "n": 3, "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens"] == 4
    assert backend.tokenised == [("a b c", False), ("d", False)]
    assert [r.prompt_ids for r in backend.requests] == [(0, 1, 2)] * 3 + [(0,)] * 3
    chat = {"messages": [{"role": "system", "content": "s"}, *USER], "n": 2, "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert backend.tokenised[2:] == [("[system] s [user] hi [assistant]", False)]


def test_a_shutdown_cuts_requests_in_flight_with_a_503_and_an_error_event() -> None:
    """uvicorn cancelled them after its grace period: a bare text 500, and streams ended without an error event."""
    fake = FakeBackend(delay=30.0)
    server = BackgroundServer(create_app(fake), shutdown_grace=0.3).start()

    async def scenario() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:

            async def stream() -> list[str]:
                body = {"prompt": "a", "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    return [line async for line in response.aiter_lines()]

            plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "a"}))
            streamed = asyncio.create_task(stream())
            await wait_until(lambda: len(fake.requests) == 2)
            started = time.monotonic()
            stopping = asyncio.create_task(asyncio.to_thread(server.stop))
            await wait_until(lambda: not plain.done() or time.monotonic() - started > 0.2)  # the grace runs
            assert not plain.done()
            results = await plain, await streamed
            await stopping
            return results

    response, lines = asyncio.run(scenario())
    assert response.status_code == 503
    assert response.json()["error"] == {
        "message": SHUTTING_DOWN,
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }
    events = sse_events(lines)
    assert events[-1]["error"]["message"] == SHUTTING_DOWN
    assert fake.cancelled == 1 and fake.abandoned_streams == 1


SERVE_SCRIPT = """
import sys
from spectot.server.app import serve

class Backend:
    name = "b"

    def failure(self):
        return None

    async def complete(self, request):
        raise NotImplementedError

    async def stream(self, request):
        raise NotImplementedError
        yield

    async def aclose(self):
        with open(sys.argv[2], "w") as f:
            f.write("closed")

serve(Backend(), port=int(sys.argv[1]), log_level="warning", shutdown_grace=0.1)
"""


def test_sigterm_closes_the_backend(tmp_path) -> None:
    """uvicorn hands a SIGTERM on to its default handler once it has shut down, which ended the process before
    ``serve`` closed the backend (the local engine's worker was never joined)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    marker = tmp_path / "closed"
    process = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(port), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
    assert marker.read_text() == "closed"


# -- end to end on a tiny model ----------------------------------------------------------------------------------
WORDS = ["<unk>", "<s>", "</s>", "<eot>", "system", "user", "assistant"] + [f"w{i}" for i in range(57)]  # 64
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)
PROMPTS = ["w1 w2 w3", "w5 w6 w7 w8 w5 w6"]
MAX_TOKENS = 12


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="<eot>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """(server, reference texts): greedy ``Pipeline`` outputs for PROMPTS, raw and as one user message, and a
    running server over ``LocalEngineBackend`` on the same weights."""
    try:
        from spectot.backends.local import LocalEngineBackend
    except ImportError as exc:
        pytest.skip(f"spectot.backends.local does not import yet: {exc}")
    from spectot.models.loader import LoadedModel
    from spectot.pipeline import Pipeline

    loaded = LoadedModel(tiny_llama(0), word_tokenizer(), name="tiny-llama", max_context=256, eos_token_ids=(3,))
    reference = {}
    for chat in (False, True):
        generations = Pipeline(loaded, chat_template=chat).generate(PROMPTS, max_new_tokens=MAX_TOKENS, method="ar")
        reference[chat] = {p: g for p, g in zip(PROMPTS, generations)}
    backend = LocalEngineBackend.from_pipeline(Pipeline(loaded))
    with BackgroundServer(create_app(backend)) as server:
        yield server, reference
    asyncio.run(backend.aclose())


def test_e2e_the_context_check_counts_the_bos_the_tokenizer_adds(tiny_llama) -> None:
    """A completion without max_tokens gets 16 tokens, or the rest of the context where that is less: with a
    tokenizer that puts a BOS before the prompt (Llama's, Mistral's), the engine gets one token more than the text
    has, and the budget leaves room for it (else the engine refuses the request)."""
    from tokenizers.processors import TemplateProcessing

    from spectot.backends.local import LocalEngineBackend
    from spectot.engine.runner import ModelRunner
    from spectot.schedulers.continuous import ContinuousEngine
    from spectot.spec.decoding import Decoder

    tokenizer = word_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama(0), max_context=16)))
    try:
        client = TestClient(create_app(LocalEngineBackend(engine, tokenizer, max_context=16)))
        response = client.post("/v1/completions", json={"prompt": "w1 w2 w3", "temperature": 0})
    finally:
        engine.close()
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == 4  # the BOS included
    assert usage["total_tokens"] <= 16


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_e2e_a_failed_engine_step_turns_health_to_503(tiny_llama, monkeypatch, error) -> None:
    """The continuous engine's worker stops for good after a failed step: every later request failed with a 500
    while /health said 200, so a load balancer kept sending work here. The step's own requests get 503 too: a
    ValueError from inside the step was answered 400, blaming a client that then did not retry elsewhere."""
    from spectot.backends.local import LocalEngineBackend
    from spectot.models.loader import LoadedModel
    from spectot.pipeline import Pipeline
    from spectot.spec.decoding import DecodeSession

    loaded = LoadedModel(tiny_llama(0), word_tokenizer(), name="tiny-llama", max_context=256, eos_token_ids=(3,))
    backend = LocalEngineBackend.from_pipeline(Pipeline(loaded))
    client = TestClient(create_app(backend))

    def out_of_memory(*args, **kwargs):
        raise error("CUDA out of memory (injected)")

    try:
        body = {"prompt": "w1 w2", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.get("/health").status_code == 200 and backend.failure() is None
        monkeypatch.setattr(DecodeSession, "verify", out_of_memory)
        assert client.post("/v1/completions", json=body).status_code == 503  # the step that failed
        monkeypatch.undo()
        response = client.get("/health")
        assert response.status_code == 503
        assert "CUDA out of memory (injected)" in response.json()["error"]["message"]
        assert "CUDA out of memory (injected)" in backend.failure()
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 503 and response.json()["error"]["code"] == "service_unavailable"
    finally:
        asyncio.run(backend.aclose())


def finish(generation) -> str:
    return "length" if generation.finish_reason == "length" else "stop"


def test_e2e_greedy_completions_equal_the_pipeline(tiny) -> None:
    server, reference = tiny
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    for prompt in PROMPTS:
        ref = reference[False][prompt]
        out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == finish(ref)
        assert out.usage.prompt_tokens == len(ref.prompt_ids)
        assert out.usage.completion_tokens == len(ref.token_ids)
        chunks = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        chunks = list(chunks)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert chunks[-1].choices[0].finish_reason == finish(ref)
        chunks = client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = list(chunks)[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_ids), len(ref.token_ids))
        scored = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
        ).choices[0]
        tokens, offsets = scored.logprobs.tokens, scored.logprobs.text_offset
        assert len(tokens) == len(offsets) == len(scored.logprobs.token_logprobs) == len(ref.token_ids)
        assert "".join(tokens).startswith(ref.text)  # the tokens of a stop string run past the cut text
        assert all(ref.text.startswith(t, o) for t, o in zip(tokens, offsets) if o + len(t) <= len(ref.text))


def test_e2e_greedy_chat_equals_the_pipeline(tiny) -> None:
    server, reference = tiny
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    for prompt in PROMPTS:
        ref = reference[True][prompt]
        messages = [{"role": "user", "content": prompt}]
        out = client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].message.content == ref.text
        assert out.usage.prompt_tokens == len(ref.prompt_ids)
        chunks = client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
        scored = client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True
        ).choices[0]
        content = scored.logprobs.content
        assert len(content) == len(ref.token_ids) and "".join(t.token for t in content).startswith(ref.text)
        assert all(bytes(t.bytes) == t.token.encode() for t in content)


def test_e2e_openai_backend_agrees_and_cancellation_is_harmless(tiny) -> None:
    from spectot.backends.openai import OpenAIBackend

    server, reference = tiny
    prompt = PROMPTS[0]

    async def scenario() -> None:
        async with OpenAIBackend.from_urls([server.url], model=None, timeout=60, max_retries=0) as backend:
            greedy = CompletionRequest(prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
            out = await backend.complete(greedy)
            assert backend.name == "tiny-llama"
            assert out.text == reference[False][prompt].text
            assert len(out.logprobs) == out.completion_tokens == len(reference[False][prompt].token_ids)
            assert "".join(out.tokens).startswith(out.text) and len(out.tokens) == len(out.logprobs)
            assert out.seconds > 0
            chat = await backend.complete(CompletionRequest(prompt, max_tokens=MAX_TOKENS, temperature=0.0, chat=True))
            assert chat.text == reference[True][prompt].text
            *pieces, ending = [p async for p in backend.stream(greedy)]
            assert "".join(pieces) == ending.text == reference[False][prompt].text
            assert ending.finish_reason == finish(reference[False][prompt])
            assert ending.completion_tokens == len(reference[False][prompt].token_ids)
            assert ending.prompt_tokens == len(reference[False][prompt].prompt_ids)

            # Abandon a long request mid-flight and a stream after its first piece, then ask again.
            long = CompletionRequest(prompt, max_tokens=200, temperature=1.0, seed=1)
            task = asyncio.create_task(backend.complete(long))
            await asyncio.sleep(0.05)
            task.cancel()
            pieces = backend.stream(long)
            await anext(pieces)
            await pieces.aclose()
            again = await asyncio.gather(*[backend.complete(greedy) for _ in range(3)])
            assert [o.text for o in again] == [reference[False][prompt].text] * 3
            assert backend.outstanding() == [0]

    asyncio.run(scenario())


# -- stress --------------------------------------------------------------------------------------------------
def stress_seconds(default: float = 60.0) -> float:
    return float(os.environ.get("SPECTOT_STRESS_SECONDS", default))


async def stress(
    url: str, model: str, reference: dict[tuple[bool, str], str], seconds: float | None = None, clients: int = 16
) -> dict[str, list[int]]:
    """``clients`` concurrent clients, each sending requests back to back for ``seconds`` (default: the env
    SPECTOT_STRESS_SECONDS, else 60): every answer must carry the expected fields, and greedy ones must match
    ``reference`` ((chat, prompt) -> text). Returns the requests sent and answered, per client."""
    seconds = stress_seconds() if seconds is None else seconds
    deadline = time.monotonic() + seconds
    sent = [0] * clients
    answered = [0] * clients
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)

    async def one_client(k: int) -> None:
        rng = random.Random(k)
        while time.monotonic() < deadline:
            prompt = rng.choice(PROMPTS)
            greedy = rng.random() < 0.5
            kind = rng.choice(["completion", "stream", "chat"])
            params = {"model": model, "max_tokens": MAX_TOKENS if greedy else rng.randint(1, 16)}
            params |= {"temperature": 0.0} if greedy else {"temperature": 1.0, "seed": rng.randrange(1000)}
            sent[k] += 1
            if kind == "completion":
                out = await client.completions.create(prompt=prompt, **params)
                assert out.object == "text_completion" and out.id and len(out.choices) == 1
                assert out.choices[0].finish_reason in ("stop", "length")
                assert 0 <= out.usage.completion_tokens <= params["max_tokens"]
                text = out.choices[0].text
            elif kind == "stream":
                chunks = await client.completions.create(prompt=prompt, stream=True, **params)
                events = [c async for c in chunks]
                assert events and events[-1].choices[0].finish_reason in ("stop", "length")
                text = "".join(c.choices[0].text for c in events)
            else:
                messages = [{"role": "user", "content": prompt}]
                out = await client.chat.completions.create(messages=messages, **params)
                assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
                text = out.choices[0].message.content
            assert isinstance(text, str)
            if greedy:
                assert text == reference[kind == "chat", prompt], (kind, prompt)
            answered[k] += 1

    try:
        await asyncio.gather(*[one_client(k) for k in range(clients)])
    finally:
        await client.close()
    return {"sent": sent, "answered": answered}


@pytest.mark.stress
def test_stress_concurrent_clients(tiny) -> None:
    server, reference = tiny
    texts = {(chat, p): g.text for chat in (False, True) for p, g in reference[chat].items()}
    seconds = stress_seconds(default=5.0)
    counts = asyncio.run(stress(server.url, "tiny-llama", texts, seconds=seconds))
    assert counts["answered"] == counts["sent"]
    assert all(n > 0 for n in counts["answered"]), counts


def test_the_listening_socket_is_bound_before_serving() -> None:
    """`serve` printed --port as given (0 printed :0) and a busy port ended in uvicorn's own error after the model
    loaded; it now binds first: the real port, or a ValueError naming the address."""
    from spectot.server.app import bind

    first = bind("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        assert port > 0
        with pytest.raises(ValueError, match=f"cannot listen at 127.0.0.1:{port}"):
            bind("127.0.0.1", port)
    finally:
        first.close()
