"""The continuous engine: requests arrive one at a time, from any thread, and share target forwards.

A level engine (serial, batched, SEED) runs a fixed set of streams to completion. A search with many
queries in flight (SPEX) and ``spectot serve`` instead see requests arrive and leave at any moment,
so this engine keeps one ``DecodeSession`` open on a worker thread and loops (vLLM's
``EngineCore.step``: schedule, execute, update):

    schedule  admit waiting requests, lowest priority value first (SPEX: primary before speculative),
              up to ``max_streams`` live streams; drop the ones whose caller gave up
    execute   prefill the admitted; one draft call + one target forward over every live stream
    update    hand new tokens to their listeners; resolve finished requests and free their KV

A request of lower priority (speculative) admitted while primary streams decode is prefilled in
chunks inside their forwards, in the rows they leave free up to ``fill_rows`` (rows a forward
carries at nearly the cost of one: t(8) ~ 1.3 t(1) on the reference CPU), so its prompt never
stalls them; a primary request is prefilled at once.

Each request keeps its own seed, so its tokens are the same whatever else is in the batch: greedy
output equals plain decoding of the target, sampled output is distributed as the target's. With a
deterministic draft (n-gram, a trained draft's top-token children: the coupled rule) the sampled tokens are
also the same; a sampling draft (an independent draft model, sampled tree children) draws on the stream's
generator as it drafts, so whether and how much a step drafts (priority, the batch's tree, adaptive k) changes
which sample comes out, never its distribution.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from spectot.engine.openmp import release_thread_pool
from spectot.spec.decoding import DecodeConfig, Decoder, StreamResult
from spectot.spec.trees.dynamic import TreeBudget

log = logging.getLogger(__name__)

TokenListener = Callable[[list[int]], None]  # called on the worker thread with each step's new tokens


@dataclass(order=True)
class _Request:
    priority: int
    order: int
    prompt: list[int] = field(compare=False)
    config: DecodeConfig = field(compare=False)
    seed: int = field(compare=False)
    future: Future = field(compare=False)
    listener: TokenListener | None = field(compare=False, default=None)


@dataclass
class EngineCounters:
    steps: int = 0  # target verification forwards
    target_forwards: int = 0  # every target forward: the verifications and the admitted prompts' prefills
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0  # requests their callers gave up, queued or running
    failed: int = 0  # requests failed alone (refused by the session, a listener that raised) or by a closed engine
    max_live: int = 0  # the most streams one forward carried (decoding, or filling a prompt in chunks)
    prompt_tokens: int = 0  # of admitted requests
    prompt_tokens_cached: int = 0  # of those, forked from the prefix cache
    prompt_tokens_prefilled: int = 0  # run through the target (the rest: cached, or a live request's same prompt)
    chunked_prefills: int = 0  # requests prefilled in chunks beside primary steps
    reprioritized: int = 0  # requests moved to another priority while queued or running


class ContinuousEngine:
    def __init__(
        self,
        decoder: Decoder,
        max_streams: int = 64,
        budget: TreeBudget | None = None,  # (live streams B, sampling) -> tree per stream
        name: str = "continuous",
        fill_rows: int = 8,  # forward rows speculative prompts may fill beside primary steps (0: prefill at once)
        draft_priority: int | None = None,  # sd streams get drafts while their priority value is <= this (None: all)
    ) -> None:
        if max_streams < 1 or fill_rows < 0:
            raise ValueError(f"need max_streams >= 1 and fill_rows >= 0, got {max_streams} and {fill_rows}")
        self.decoder, self.max_streams, self.budget, self.name = decoder, max_streams, budget, name
        self.fill_rows, self.draft_priority = fill_rows, draft_priority
        self.counters = EngineCounters()
        self._waiting: list[_Request] = []
        self._requests: dict[Future, _Request] = {}  # not yet resolved, by their future: ``reprioritize`` finds them
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._failure: BaseException | None = None  # what ended the worker, if a step failed: submit() refuses work
        release_thread_pool()  # the worker takes over the model: its OpenMP pool must be the only one
        self._thread = threading.Thread(target=self._loop, name="spectot-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: Sequence[int],
        config: DecodeConfig,
        seed: int,
        listener: TokenListener | None = None,
        priority: int = 0,
    ) -> Future[StreamResult]:
        """Queue one generation; cancel the returned future to abandon it (its KV is freed at the next step).

        Raises ``RuntimeError`` at once when the engine is closed or its worker has stopped (nothing would run it)."""
        future: Future[StreamResult] = Future()
        request = _Request(priority, next(self._order), list(prompt), config, seed, future, listener)
        with self._wake:
            if self._failure is not None:
                raise RuntimeError(f"the engine stopped after a failed step: {self._failure!r}") from self._failure
            if self._closed:
                raise RuntimeError("the engine is closed")
            heapq.heappush(self._waiting, request)
            self._requests[future] = request
            self._wake.notify()
        future.add_done_callback(self._forget)
        return future

    @property
    def failure(self) -> BaseException | None:
        """What stopped the worker (a step that failed as a whole), or None while it serves (read under no lock:
        a reference, set once)."""
        return self._failure

    def reprioritize(self, future: Future[StreamResult], priority: int) -> None:
        """Move a queued or running request to ``priority``: its place in the admission order and whether it gets
        drafts (``draft_priority``) follow from the next step on, and a prompt being filled in chunks raised to
        primary (<= 0) is filled at once. Its tokens do not change (each request keeps its seed). A resolved
        request is left alone."""
        with self._wake:
            request = self._requests.get(future)
            if request is None or request.priority == priority:
                return
            request.priority = priority
            heapq.heapify(self._waiting)
            self.counters.reprioritized += 1

    def _forget(self, future: Future) -> None:
        with self._wake:
            self._requests.pop(future, None)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    # -- the worker ------------------------------------------------------------------------------
    def _loop(self) -> None:
        with self.decoder.session([], DecodeConfig()) as session:
            live: dict[int, _Request] = {}  # stream key -> its request
            streams: dict[int, object] = {}
            admitted: list[_Request] | None = []  # popped off the queue, not live yet until _execute adds them
            try:
                while True:
                    admitted = self._schedule(live)
                    if admitted is None:
                        break
                    self._execute(session, live, streams, admitted)
            except BaseException as error:  # a failed step fails every request it held, not the process
                log.exception("engine step failed")
                with self._wake:  # under the lock: a request submitted from now on is refused, none is stranded
                    self._failure = error
                    waiting = self._drain()
                for request in [*live.values(), *(admitted or []), *waiting]:  # _fail leaves resolved ones alone
                    _fail(request.future, error)
                session.close(keep=False)  # nothing of a failed step goes to the shared prefix cache

    def _schedule(self, live: dict[int, _Request]) -> list[_Request] | None:
        """Waiting requests to admit now (blocks while there is nothing to do); None once closed."""
        with self._wake:
            while not live and not self._waiting and not self._closed:
                self._wake.wait()
            if self._closed:  # queued and running requests fail: nobody waits on a closed engine
                # (a cancelled future would read, through asyncio.wrap_future, as its awaiting task cancelled)
                for request in self._drain():
                    _fail(request.future, RuntimeError("the engine was closed before the request ran"))
                    self.counters.failed += 1
                for request in live.values():
                    _fail(request.future, RuntimeError("the engine was closed while the request ran"))
                    self.counters.failed += 1
                return None
            admitted = []
            while self._waiting and len(live) + len(admitted) < self.max_streams:
                request = heapq.heappop(self._waiting)
                if request.future.cancelled():  # given up while queued
                    self.counters.cancelled += 1
                else:
                    admitted.append(request)
            return admitted

    def _drain(self) -> list[_Request]:
        waiting, self._waiting = self._waiting, []
        return waiting

    def _execute(self, session, live: dict[int, _Request], streams: dict[int, object], admitted) -> None:
        for key, request in list(live.items()):  # callers that gave up
            if request.future.cancelled():
                _forget(session, live, streams, key)
                self.counters.cancelled += 1
        new = []
        for request in admitted:
            try:
                [s] = session.add([request.prompt], request.config, [request.seed])
            except Exception as error:  # a bad request (too long, no draft for sd, a seed torch refuses) fails alone
                _fail(request.future, error)
                self.counters.failed += 1
                continue
            live[s.key], streams[s.key] = request, s
            new.append(s)
        self.counters.admitted += len(new)
        primary = any(live[k].priority <= 0 and s.finish is None and not s.to_fill for k, s in streams.items())
        chunked = [s for s in new if self.fill_rows and primary and live[s.key].priority > 0]
        whole = [s for s in new if s not in chunked]
        if chunked:
            session.begin(chunked)
            self.counters.chunked_prefills += len(chunked)
        if whole:
            session.prefill(whole)
            self.counters.target_forwards = session.batch.target_forwards
            self._update(session, live, streams, whole, {s.key: 0 for s in whole})
        self.counters.prompt_tokens += sum(len(s.prompt) for s in new)
        self.counters.prompt_tokens_cached = session.cached_tokens
        self.counters.prompt_tokens_prefilled = session.prefilled_tokens
        active = [s for s in streams.values() if s.finish is None and not s.to_fill]
        # oldest first, but a prompt raised to primary while it filled goes first and whole (a search took it over)
        waiting = sorted((s for s in streams.values() if s.to_fill), key=lambda s: live[s.key].priority > 0)
        if not active and not waiting:
            return
        before = {s.key: len(s.generated) for s in active + waiting}
        drafts = self._propose(session, active, live)
        free = self.fill_rows - sum(1 + d.tokens.numel() for d in drafts)  # rows left beside the primary steps
        if not active:  # nothing decodes: prefill the rest at once
            free = sum(s.to_fill for s in waiting)
        filling = []
        for s in waiting:  # at least one token a step, so none waits forever
            primary_now = live[s.key].priority <= 0
            take = s.to_fill if primary_now else min(s.to_fill, max(free, 0 if filling else 1))
            if take == 0:
                break
            filling.append((s, take))
            free -= take
        session.verify(active, drafts, filling)
        self.counters.steps += 1
        self.counters.target_forwards = session.batch.target_forwards
        self.counters.max_live = max(self.counters.max_live, len(active) + len(filling))
        self.counters.prompt_tokens_prefilled = session.prefilled_tokens
        done_filling = [s for s, _ in filling if not s.to_fill]
        self._update(session, live, streams, active + done_filling, before)

    def _propose(self, session, active: list, live: dict[int, _Request]) -> list:
        """Drafts for the live streams whose priority gets them (``draft_priority``); with a budget, each
        sampling's streams get the tree it picks for that sampling and the number of streams sharing the forward."""
        limit = self.draft_priority

        def drafted(streams: list) -> list[bool] | None:  # None: every sd stream
            return None if limit is None else [live[s.key].priority <= limit for s in streams]

        if self.budget is None:
            return session.propose(active, drafted=drafted(active))
        drafts = {}
        for sampling in dict.fromkeys(s.config.sampling for s in active):
            group = [s for s in active if s.config.sampling == sampling]
            tree = self.budget(len(active), sampling)
            drafts.update(zip((s.key for s in group), session.propose(group, tree, drafted(group))))
        return [drafts[s.key] for s in active]

    def _update(self, session, live, streams, touched, before: dict[int, int]) -> None:
        for s in touched:
            request = live[s.key]
            if request.listener is not None and len(s.generated) > before[s.key]:
                try:
                    request.listener(s.generated[before[s.key] :])
                except Exception as error:  # the caller's hook (its event loop closed, ...) fails its request alone
                    log.warning("a token listener failed: dropping its request", exc_info=True)
                    _fail(request.future, error)
                    self.counters.failed += 1
                    _forget(session, live, streams, s.key)
                    continue
            if s.finish is not None:
                result = session.result(s)
                _forget(session, live, streams, s.key)
                try:
                    request.future.set_result(result)
                    self.counters.finished += 1
                except InvalidStateError:  # cancelled while its last step ran
                    self.counters.cancelled += 1


def _forget(session, live: dict[int, _Request], streams: dict[int, object], key: int) -> None:
    """A request leaves the engine (finished, failed or cancelled): its stream's KV is freed."""
    session.release(streams.pop(key))
    del live[key]


def _fail(future: Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass
