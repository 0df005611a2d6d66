"""What a search asks of a language model, whoever serves it: one completion per request.

A *backend* turns a ``CompletionRequest`` into a ``Completion``, asynchronously, so a search (and SPEX's
speculative producers) can keep many requests in flight and cancel the ones it no longer needs
(``asyncio`` task cancellation). Two kinds exist, as in outlines: *steerable* — the local engine
(``backends/local.py``), which batches concurrent requests into shared target forwards and runs
token-level speculative decoding inside each — and *black-box* — an OpenAI-compatible server such as
vLLM or SGLang (``backends/openai.py``).

A request's ``seed`` fixes its samples: the local engine draws a request's tokens from its own
generator, so the same request gives the same text however requests are batched or scheduled — with no
draft or a deterministic one (n-gram, a trained draft's top-token children). A sampling draft (an independent
draft model, sampled tree children) draws on that generator as it drafts, so there the seed fixes the
distribution, and the text depends on how the request was drafted.

A backend also says whether it can still serve (``failure``: None while it can, else why not; the local
engine's worker stops for good after a failed step), which ``spectot serve``'s ``/health`` reports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from spectot.spec.decoding import PromptRefused, check_stop

FinishReason = Literal["stop", "length"]  # OpenAI's words: EOS and stop strings are both "stop"


class LivePriority:
    """A request priority its owner may change while the request runs (SPEX: a speculative step the search
    takes over is primary work from then on). A backend that can re-rank queued and running work watches it
    (the local engine: admission order, and which streams get drafts); the others read ``value`` once.

    Example: ``p = LivePriority(2); undo = p.watch(print); p.set(0)`` prints 0; after ``undo()`` nothing is told.
    """

    def __init__(self, value: int) -> None:
        self.value = value
        self._watchers: list[Callable[[int], None]] = []

    def set(self, value: int) -> None:
        if value != self.value:
            self.value = value
            for watcher in list(self._watchers):
                watcher(value)

    def watch(self, watcher: Callable[[int], None]) -> Callable[[], None]:
        """Call ``watcher(value)`` at every change until the returned function is called."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str  # the raw prompt text (a chat prompt is rendered before it gets here)
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: the backend picks one
    logprobs: bool = False  # return each generated token's log-probability under the target
    priority: int = 0  # lower runs first when the backend must queue (SPEX: primary 0, next 1, speculative 2)
    chat: bool = False  # the prompt is one user message: the backend applies the model's chat template
    live_priority: LivePriority | None = None  # where the owner may change ``priority`` while it runs
    top_k: int = 0  # sample among the k likeliest tokens only (0 = off)
    # ``prompt`` as this backend tokenises it (``spectot serve`` tokenises once, off its event loop, and every
    # choice of the prompt reuses the ids); None: the backend tokenises ``prompt`` itself
    prompt_ids: tuple[int, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        check_stop(self.stop)

    @classmethod
    def make_dummy(cls, prompt: str = "1 + 1 =", max_tokens: int = 8) -> CompletionRequest:
        return cls(prompt, max_tokens, seed=0)


@dataclass
class Completion:
    text: str  # the generated text, cut before any stop string
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] = field(default_factory=list)  # one per generated token when asked for
    # with logprobs: the text each generated token adds (the local engine's pieces join to the text before any
    # stop cut, a character's bytes waiting for its last token; a server's are its own token strings, which may
    # differ there); [] when the backend does not say
    tokens: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time from submission to the last token (queueing included)

    @property
    def mean_logprob(self) -> float:
        """The policy's own confidence in the text: the mean token log-probability (0.0 when none)."""
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else 0.0


class AsyncBackend(Protocol):
    name: str

    async def complete(self, request: CompletionRequest) -> Completion:
        """One completion; cancelling the awaiting task abandons the request (the backend frees it)."""
        ...

    def stream(self, request: CompletionRequest) -> AsyncIterator[str | Completion]:
        """The completion's text as it is generated, in pieces (a server's ``stream: true``), then the
        ``Completion`` itself (its text the pieces joined): how it finished and how many tokens it took."""
        ...

    def failure(self) -> str | None:
        """None while the backend can serve requests; else why it cannot (every request would fail)."""
        ...

    async def aclose(self) -> None: ...


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is a request's own, raised again however often it is sent while other requests go on: a
    prompt the local engine cannot run (``PromptRefused``), or one a server refused (``OpenAIBackendError.refused``).
    A search fails its query alone on one; any other error (the engine stopped, a server unreachable) ends the run."""
    return isinstance(error, PromptRefused) or getattr(error, "refused", False) is True
