"""The continuous engine: requests that arrive at any time, from any thread, decode exactly.

- greedy fp32: requests submitted while others run (ar and sd, chain and tree drafts) give token for
  token what the level decoder gives each prompt alone;
- sampled: a request's tokens depend only on its seed, not on what shares its forwards;
- a cancelled request is dropped and its KV freed; priorities decide admission, and a request moved to
  another priority takes its new place (in the queue, and in getting drafts under ``draft_priority``); a bad
  request (too long, a seed torch refuses, a listener that raises) fails alone, and once a whole step fails
  the engine refuses new work instead of queueing it forever.
"""

from __future__ import annotations

import threading
import time

import pytest

from spectot.engine.runner import ModelRunner
from spectot.schedulers.continuous import ContinuousEngine
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.proposers.ngram import NgramProposer
from spectot.spec.sampling import SamplingParams
from spectot.spec.trees.dynamic import StaticPolicy
from spectot.spec.trees.shapes import k_config_tree

PROMPTS = [[3, 4, 5, 6, 3, 4], [7, 8, 9], [3, 4, 5, 6, 3, 4], [10, 11, 12, 13, 14, 10, 11], [5]]


def reference(target, prompts, config, seeds):
    return [r.token_ids for r in Decoder(ModelRunner(target)).generate(prompts, config, seeds)]


@pytest.mark.parametrize("method,tree", [("ar", None), ("sd", None), ("sd", (2, 2, 1))])
def test_greedy_staggered_requests_equal_plain_decoding(tiny_llama, method, tree) -> None:
    target = tiny_llama()
    config = DecodeConfig(max_new_tokens=16, method=method, num_draft_tokens=4)
    seeds = list(range(len(PROMPTS)))
    want = reference(target, PROMPTS, DecodeConfig(max_new_tokens=16), seeds)
    policy = StaticPolicy(tuple(k_config_tree(tree))) if tree else None
    decoder = Decoder(ModelRunner(target), proposer=NgramProposer(width=2) if method == "sd" else None)
    engine = ContinuousEngine(decoder, budget=(lambda b, sampling: policy) if policy else None)
    try:
        futures = []
        for p, seed in zip(PROMPTS, seeds):
            futures.append(engine.submit(p, config, seed))
            time.sleep(0.01)  # later requests join streams already decoding
        got = [f.result(timeout=60).token_ids for f in futures]
    finally:
        engine.close()
    assert got == want
    assert engine.counters.finished == len(PROMPTS)


def test_sampled_tokens_depend_only_on_the_seed(tiny_llama) -> None:
    target = tiny_llama()
    config = DecodeConfig(max_new_tokens=12, sampling=SamplingParams(do_sample=True, temperature=1.0))
    alone = reference(target, [PROMPTS[1]], config, [42])[0]
    engine = ContinuousEngine(Decoder(ModelRunner(target)))
    try:
        crowd = [engine.submit(p, config, seed) for seed, p in enumerate(PROMPTS)]
        mine = engine.submit(PROMPTS[1], config, 42)
        assert mine.result(timeout=60).token_ids == alone
        [f.result(timeout=60) for f in crowd]
    finally:
        engine.close()


def test_cancelled_request_frees_its_kv_and_others_finish(tiny_llama) -> None:
    target = tiny_llama()
    runner = ModelRunner(target)
    engine = ContinuousEngine(Decoder(runner))
    try:
        holder: list = []
        cancel = lambda ids: holder[0].cancel() if holder else None  # noqa: E731  (given up while it decodes)
        holder.append(engine.submit(PROMPTS[0], DecodeConfig(max_new_tokens=200), 0, listener=cancel))
        doomed = holder[0]
        kept = engine.submit(PROMPTS[1], DecodeConfig(max_new_tokens=8), 1)
        assert len(kept.result(timeout=60).token_ids) == 8
        deadline = time.time() + 10
        while engine.counters.cancelled + engine.counters.finished < 2 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        engine.close()
    assert doomed.cancelled()
    engine.decoder.prefix_cache.clear()
    assert runner.cache.used == 0  # every slot released but the prefix cache's: the cancelled stream and its prompt KV


def _blocked(engine: ContinuousEngine):
    """A request holding the engine's only slot, and the engine itself (in its token listener), until the event
    is set: requests submitted meanwhile queue."""
    queued = threading.Event()
    return engine.submit([3, 4], DecodeConfig(max_new_tokens=30), 0, listener=lambda ids: queued.wait(10)), queued


def test_priority_orders_admission(tiny_llama) -> None:
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())), max_streams=1)
    order: list[str] = []
    try:
        blocker, queued = _blocked(engine)
        late = engine.submit([5, 6], DecodeConfig(max_new_tokens=2), 1, priority=1)
        urgent = engine.submit([7, 8], DecodeConfig(max_new_tokens=2), 2, priority=0)
        late.add_done_callback(lambda f: order.append("speculative"))
        urgent.add_done_callback(lambda f: order.append("primary"))
        queued.set()
        for f in (blocker, late, urgent):
            f.result(timeout=60)
    finally:
        engine.close()
    assert order == ["primary", "speculative"]
    assert engine.counters.max_live == 1


def test_a_request_given_up_while_queued_is_counted_cancelled(tiny_llama) -> None:
    """Only requests cancelled while they ran were counted; one given up in the queue was skipped unseen."""
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())), max_streams=1)
    try:
        blocker, queued = _blocked(engine)
        given_up = engine.submit([5, 6], DecodeConfig(max_new_tokens=2), 1)
        assert given_up.cancel()
        after = engine.submit([7, 8], DecodeConfig(max_new_tokens=2), 2)
        queued.set()
        blocker.result(timeout=60), after.result(timeout=60)
    finally:
        engine.close()
    assert (engine.counters.cancelled, engine.counters.finished) == (1, 2)


def test_a_step_that_fails_fails_the_requests_it_was_admitting(tiny_llama) -> None:
    """Requests popped off the queue for a step are not live until the step adds them: a step failing before
    that (here releasing a cancelled stream, as a device error would) left them pending forever."""
    decoder = Decoder(ModelRunner(tiny_llama()))
    engine = ContinuousEngine(decoder)
    keep, broken = decoder.prefix_cache.keep, threading.Event()

    def failing_keep(*args, **kwargs):
        if broken.is_set():
            raise RuntimeError("device error while releasing")
        return keep(*args, **kwargs)

    decoder.prefix_cache.keep = failing_keep
    stepping, go = threading.Event(), threading.Event()
    try:
        running = engine.submit(
            [3, 4, 5, 6], DecodeConfig(max_new_tokens=100), 0, listener=lambda ids: (stepping.set(), go.wait(10))
        )
        stepping.wait(10)
        running.cancel()
        admitted = engine.submit([7, 8, 9], DecodeConfig(max_new_tokens=4), 1)
        broken.set()
        go.set()
        with pytest.raises(RuntimeError, match="device error while releasing"):
            admitted.result(timeout=30)
    finally:
        engine.close()


def test_reprioritize_moves_a_queued_request_ahead(tiny_llama) -> None:
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())), max_streams=1)
    order: list[str] = []
    try:
        blocker, queued = _blocked(engine)
        first = engine.submit([5, 6], DecodeConfig(max_new_tokens=2), 1, priority=1)
        taken_over = engine.submit([7, 8], DecodeConfig(max_new_tokens=2), 2, priority=2)
        engine.reprioritize(taken_over, 0)
        first.add_done_callback(lambda f: order.append("first"))
        taken_over.add_done_callback(lambda f: order.append("taken over"))
        queued.set()
        for f in (blocker, first, taken_over):
            f.result(timeout=60)
        engine.reprioritize(first, 0)  # resolved: left alone
    finally:
        engine.close()
    assert order == ["taken over", "first"]
    assert engine.counters.reprioritized == 1


def test_draft_priority_drafts_for_a_request_from_its_promotion_on(tiny_llama) -> None:
    """With ``draft_priority=0`` a speculative sd request decodes without drafts until it is moved to priority
    0, then gets them; its tokens are plain decoding's either way."""
    target = tiny_llama()
    config = DecodeConfig(max_new_tokens=24, method="sd", num_draft_tokens=4)
    prompt = PROMPTS[0]
    want = reference(target, [prompt], DecodeConfig(max_new_tokens=24), [0])[0]
    engine = ContinuousEngine(Decoder(ModelRunner(target), proposer=NgramProposer(width=2)), draft_priority=0)
    try:
        primary = engine.submit(prompt, config, 0, priority=0).result(timeout=60)
        speculative = engine.submit(prompt, config, 0, priority=2).result(timeout=60)
        holder: list = []
        seen: list[int] = []  # taken over once 8 tokens are out

        def promote(ids: list[int]) -> None:
            seen.extend(ids)
            if len(seen) >= 8 and holder:
                engine.reprioritize(holder[0], 0)

        holder.append(engine.submit(prompt, config, 0, listener=promote, priority=2))
        promoted = holder[0].result(timeout=60)
    finally:
        engine.close()
    assert primary.token_ids == speculative.token_ids == promoted.token_ids == want
    assert primary.stats.proposed > 0 and speculative.stats.proposed == 0
    assert 0 < promoted.stats.proposed
    assert promoted.stats.verify_steps > primary.stats.verify_steps  # its first steps went undrafted


def test_a_prompt_too_long_fails_alone(tiny_llama) -> None:
    runner = ModelRunner(tiny_llama(), max_context=64)
    engine = ContinuousEngine(Decoder(runner))
    try:
        bad = engine.submit(list(range(3, 60)), DecodeConfig(max_new_tokens=32), 0)
        with pytest.raises(ValueError, match="exceeds the model's context"):
            bad.result(timeout=60)
        good = engine.submit([3, 4], DecodeConfig(max_new_tokens=4), 0)
        assert len(good.result(timeout=60).token_ids) == 4
    finally:
        engine.close()


@pytest.mark.parametrize("urgent", [0, -1])  # a priority more urgent than 0 is primary work too
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=1.0)])
def test_speculative_prompts_prefilled_in_chunks_beside_primary_steps_decode_exactly(
    tiny_llama, sampling, urgent: int
) -> None:
    """Low-priority requests that arrive while a primary one decodes run their prompts a few tokens per
    forward (fill_rows), and still give exactly the tokens of prefilling at once (fp32, same seeds)."""
    target = tiny_llama()
    config = DecodeConfig(max_new_tokens=12, sampling=sampling)
    long_prompts = [[(7 * i + j) % 50 + 3 for j in range(30)] for i in range(3)]
    want = reference(target, [PROMPTS[3], *long_prompts], config, [0, 1, 2, 3])
    started = []
    engine = ContinuousEngine(Decoder(ModelRunner(target)), fill_rows=4)
    try:
        primary = engine.submit(
            PROMPTS[3], DecodeConfig(max_new_tokens=60, sampling=sampling), 0, started.append, priority=urgent
        )
        deadline = time.time() + 10
        while not started and time.time() < deadline:
            time.sleep(0.001)
        speculative = [engine.submit(p, config, i + 1, priority=1) for i, p in enumerate(long_prompts)]
        got = [f.result(timeout=60).token_ids for f in speculative]
        first = primary.result(timeout=60).token_ids
    finally:
        engine.close()
    assert engine.counters.chunked_prefills == 3
    assert got == want[1:]
    assert first[:12] == want[0]  # the primary decodes exactly as alone, too
    assert engine.counters.prompt_tokens_prefilled >= sum(len(p) for p in long_prompts)


def test_an_edd_draft_gets_the_target_hidden_states_in_the_continuous_engine(tiny_llama) -> None:
    """The engine's session starts with no streams (an ``ar`` config); requests that decode with an EDD
    draft join later and still get the target's hidden states: greedy tokens equal plain decoding."""
    import torch

    from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint
    from spectot.spec.proposers.draft_decoder import DraftDecoderProposer

    target = tiny_llama()
    head_ids = torch.arange(0, 64, 2)
    config = DraftDecoderConfig("edd", 1, -2, head_ids.numel(), fingerprint(target), target.config.to_dict())
    draft = DraftDecoder.initialise(config, target, head_ids).eval()
    decoder = Decoder(ModelRunner(target), proposer=DraftDecoderProposer(draft, ModelRunner(draft.model)))
    want = reference(target, PROMPTS[:3], DecodeConfig(max_new_tokens=10), [0, 1, 2])
    engine = ContinuousEngine(decoder)
    try:
        sd = DecodeConfig(max_new_tokens=10, method="sd", num_draft_tokens=3)
        got = [f.result(timeout=60).token_ids for f in [engine.submit(p, sd, i) for i, p in enumerate(PROMPTS[:3])]]
    finally:
        engine.close()
    assert got == want


def test_edd_requests_prefilled_in_chunks_get_every_prompt_tokens_hidden_state(tiny_llama) -> None:
    """Speculative EDD requests prefilled in chunks beside a primary one collect each chunk's hidden
    states: their tokens and their drafts' confidences equal those of the same requests prefilled at
    once (fp32), where a missing chunk would stop the draft and a misplaced one would move its confidences."""
    import torch

    from spectot.models.draft_decoder import DraftDecoder, DraftDecoderConfig, fingerprint
    from spectot.spec.proposers.draft_decoder import DraftDecoderProposer

    target = tiny_llama()
    head_ids = torch.arange(0, 64, 2)
    config = DraftDecoderConfig("edd", 1, -2, head_ids.numel(), fingerprint(target), target.config.to_dict())
    draft = DraftDecoder.initialise(config, target, head_ids).eval()
    with torch.no_grad():  # a draft that reads its hidden states visibly (an untrained one barely does)
        weight = draft.hidden_proj.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    sd = DecodeConfig(max_new_tokens=12, method="sd", num_draft_tokens=3)
    long_prompts = [[(7 * i + j) % 50 + 3 for j in range(30)] for i in range(3)]

    def run(fill_rows: int) -> tuple[list, list, int]:
        proposer = DraftDecoderProposer(draft, ModelRunner(draft.model), prefix_tokens=0)
        engine = ContinuousEngine(Decoder(ModelRunner(target), proposer=proposer), fill_rows=fill_rows)
        started = []
        try:
            primary = engine.submit(PROMPTS[3], DecodeConfig(max_new_tokens=60), 0, started.append)
            deadline = time.time() + 10
            while not started and time.time() < deadline:
                time.sleep(0.001)
            results = [engine.submit(p, sd, i + 1, priority=1).result(timeout=60) for i, p in enumerate(long_prompts)]
            primary.result(timeout=60)
        finally:
            engine.close()
        confidences = [r.stats.calibration_confidence for r in results]
        return [r.token_ids for r in results], confidences, engine.counters.chunked_prefills

    tokens, confidences, chunked = run(fill_rows=4)
    want_tokens, want_confidences, none = run(fill_rows=0)
    assert chunked == 3 and none == 0
    assert tokens == want_tokens
    assert torch.allclose(torch.tensor(confidences), torch.tensor(want_confidences), rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", [2**64, 1.5])
def test_a_seed_torch_refuses_fails_alone(tiny_llama, seed) -> None:
    """A request whose admission raises (torch refuses the seed: ValueError past 2**64 - 1 here, RuntimeError in
    some torch versions and for a non-integer) fails its own future; the worker serves the next request."""
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())))
    try:
        bad = engine.submit([3, 4], DecodeConfig(max_new_tokens=4), seed)
        with pytest.raises((ValueError, RuntimeError)):
            bad.result(timeout=60)
        good = engine.submit([3, 4], DecodeConfig(max_new_tokens=4), 0)
        assert len(good.result(timeout=60).token_ids) == 4
    finally:
        engine.close()


def test_a_failing_listener_fails_its_request_alone(tiny_llama) -> None:
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())))

    def broken(ids: list[int]) -> None:
        raise RuntimeError("the caller's loop is closed")

    try:
        bad = engine.submit([3, 4], DecodeConfig(max_new_tokens=8), 0, listener=broken)
        good = engine.submit([5, 6], DecodeConfig(max_new_tokens=8), 1)
        with pytest.raises(RuntimeError, match="loop is closed"):
            bad.result(timeout=60)
        assert len(good.result(timeout=60).token_ids) == 8
        assert len(engine.submit([7], DecodeConfig(max_new_tokens=2), 2).result(timeout=60).token_ids) == 2
    finally:
        engine.close()
    engine.decoder.prefix_cache.clear()
    assert engine.decoder.runner.cache.used == 0  # the dropped request's KV was released


def test_a_token_id_outside_the_vocabulary_fails_alone(tiny_llama) -> None:
    target = tiny_llama()
    engine = ContinuousEngine(Decoder(ModelRunner(target)))
    vocab = target.get_input_embeddings().num_embeddings
    try:
        good = engine.submit([3, 4], DecodeConfig(max_new_tokens=8), 0)
        for bad_id in (vocab, -1):
            with pytest.raises(ValueError, match="outside the model's vocabulary"):
                engine.submit([3, bad_id], DecodeConfig(max_new_tokens=4), 0).result(timeout=60)
        assert len(good.result(timeout=60).token_ids) == 8
        assert len(engine.submit([5], DecodeConfig(max_new_tokens=2), 0).result(timeout=60).token_ids) == 2
    finally:
        engine.close()


def test_closing_the_engine_fails_the_requests_it_runs(tiny_llama) -> None:
    """Nobody waits forever on a closed engine: a running request fails, a queued one too (it was cancelled,
    which asyncio.wrap_future hands its awaiting task as the task's own cancellation)."""
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())), max_streams=1)
    started = threading.Event()
    running = engine.submit([3, 4], DecodeConfig(max_new_tokens=1500), 0, listener=lambda ids: started.set())
    queued = engine.submit([5, 6], DecodeConfig(max_new_tokens=4), 1)
    assert started.wait(60)
    engine.close()
    with pytest.raises(RuntimeError, match="engine was closed"):
        running.result(timeout=10)
    with pytest.raises(RuntimeError, match="closed before the request ran"):
        queued.result(timeout=10)
    assert (engine.counters.failed, engine.counters.cancelled) == (2, 0)  # the queue drained on close counts
    engine.decoder.prefix_cache.clear()
    assert engine.decoder.runner.cache.used == 0


def test_a_stopped_engine_refuses_new_work_at_once(tiny_llama) -> None:
    """A step that fails as a whole (here the tree budget) fails the requests it held and ends the worker; from
    then on submit() raises instead of queueing work nothing will run."""

    def broken_budget(streams: int, sampling: SamplingParams):
        raise RuntimeError("no tree for you")

    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())), budget=broken_budget)
    try:
        held = engine.submit([3, 4], DecodeConfig(max_new_tokens=4), 0)
        with pytest.raises(RuntimeError, match="no tree for you"):
            held.result(timeout=60)
        with pytest.raises(RuntimeError, match="engine stopped.*no tree for you"):
            engine.submit([3, 4], DecodeConfig(max_new_tokens=4), 0)
    finally:
        engine.close()


def test_a_failed_step_keeps_nothing_in_the_prefix_cache(tiny_llama) -> None:
    """The failure was caught inside the engine's session, which then closed as a clean one: the failed streams'
    KV went to the prefix cache every engine of the runner shares. (Their prompt, prefilled before, stays.)"""
    calls = []

    def budget_failing_later(streams: int, sampling: SamplingParams):
        calls.append(streams)
        if len(calls) > 2:
            raise RuntimeError("no tree for you")
        return None

    decoder = Decoder(ModelRunner(tiny_llama()), prefix_cache_tokens=4096)
    engine = ContinuousEngine(decoder, budget=budget_failing_later)
    try:
        held = engine.submit(list(range(3, 30)), DecodeConfig(max_new_tokens=16), 0)
        with pytest.raises(RuntimeError, match="no tree for you"):
            held.result(timeout=60)
    finally:
        engine.close()
    assert decoder.prefix_cache.held_tokens == 27  # the prompt's entry alone, none of the tokens generated


def test_a_failed_stream_stops_its_levels_siblings(tiny_llama) -> None:
    """``run`` raised at the first failed stream and left the others decoding for nobody (a level's forwards charged
    to whatever ran next)."""
    from spectot.schedulers.base import Level
    from spectot.schedulers.chained import ContinuousLevelEngine

    runner = ModelRunner(tiny_llama(), max_context=64)
    engine = ContinuousLevelEngine(ContinuousEngine(Decoder(runner)))
    try:
        level = Level([list(range(3, 60)), [3, 4], [5, 6], [7, 8]], DecodeConfig(max_new_tokens=40), [0, 1, 2, 3])
        with pytest.raises(ValueError, match="exceeds the model's context"):
            engine.run(level)
        steps = engine.engine.counters.steps
        time.sleep(0.5)
        assert engine.engine.counters.steps <= steps + 1  # at most the step running when they were cancelled
    finally:
        engine.close()


def test_a_level_on_the_continuous_engine_counts_its_own_forwards(tiny_llama) -> None:
    """The engine's one session lives as long as the engine: its results' forward counts are running totals, so
    levels counted by them grew 8, 16, 24 (48 in all for 24 forwards)."""
    from spectot.schedulers.chained import ContinuousLevelEngine
    from spectot.search.policy import GenerationCall, LocalBackend
    from spectot.tasks.base import StepRequest

    engine = ContinuousLevelEngine(ContinuousEngine(Decoder(ModelRunner(tiny_llama()))))
    backend = LocalBackend(lambda text: [3 + int(w[1:]) for w in text.split()], str, engine, "ar", 1)
    try:
        for level in range(3):
            request = StepRequest(f"w{level} w5", (), 8)
            backend.generate(GenerationCall([request], 0.0, [level], "TG"))
    finally:
        engine.close()
    assert 0 < backend.stats["TG"].target_forwards <= 3 * 8


def test_a_requests_statistics_cover_its_own_time_in_the_engine(tiny_llama) -> None:
    """The engine's one session outlives its requests: a request's forwards and times are those of the steps it
    was in (they were the session's running totals, and time_total was 0)."""
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())))
    try:
        first = engine.submit([3, 4, 5], DecodeConfig(max_new_tokens=8), 0).result(timeout=60)
        second = engine.submit([7, 8], DecodeConfig(max_new_tokens=8), 1).result(timeout=60)
    finally:
        engine.close()
    for r in (first, second):  # a prefill forward, then one verification forward per later token
        assert r.stats.target_forwards == 1 + r.stats.verify_steps == len(r.token_ids) == 8
        assert r.stats.time_total > 0
        assert r.stats.time_verify <= r.stats.time_total
    assert engine.counters.steps == 2 * 7
    assert engine.counters.target_forwards == 2 * 8  # the prefills too: level engines count them, it did not


def test_counters_count_chunk_filling_streams_and_a_cancel_in_the_last_step(tiny_llama) -> None:
    """``max_live`` left out the streams a forward carried to fill their prompts in chunks; a request cancelled
    while its last step ran (here by its own listener) counted as finished."""
    engine = ContinuousEngine(Decoder(ModelRunner(tiny_llama())), fill_rows=4)
    started = threading.Event()
    try:
        primary = engine.submit([3, 4], DecodeConfig(max_new_tokens=200), 0, lambda ids: started.set())
        assert started.wait(60)
        one_token = DecodeConfig(max_new_tokens=1)  # done when its prompt is: never a decoding stream
        engine.submit([(5 * j) % 50 + 3 for j in range(30)], one_token, 1, priority=1).result(timeout=60)
        box: list = []
        known = threading.Event()  # the listener runs on the worker, maybe before submit() returns
        box.append(engine.submit([7, 8, 9], one_token, 2, lambda ids: known.wait(10) and box[0].cancel()))
        known.set()
        primary.result(timeout=60)
        deadline = time.time() + 10
        while engine.counters.cancelled + engine.counters.finished < 3 and time.time() < deadline:
            time.sleep(0.001)
    finally:
        engine.close()
    assert engine.counters.max_live == 2
    assert box[0].cancelled() and (engine.counters.cancelled, engine.counters.finished) == (1, 2)


def test_a_prompt_raised_to_primary_while_it_fills_in_chunks_is_filled_at_once(tiny_llama) -> None:
    """A pre-run the search takes over is raised to primary; if its prompt was being filled in chunks beside the
    primary steps, it went on trickling in (a 300-token prompt's first token came 75 steps later). Its tokens stay
    those of plain decoding."""
    target = tiny_llama()
    prompt = [(7 * j) % 50 + 3 for j in range(80)]
    config = DecodeConfig(max_new_tokens=4)
    want = reference(target, [prompt], config, [5])[0]
    engine = ContinuousEngine(Decoder(ModelRunner(target)), fill_rows=4)
    started, first = threading.Event(), {}
    try:
        primary = engine.submit([3, 4], DecodeConfig(max_new_tokens=1500), 0, lambda ids: started.set())
        assert started.wait(60)
        future = engine.submit(prompt, config, 5, lambda ids: first.setdefault("step", engine.counters.steps), 1)
        deadline = time.time() + 30
        while engine.counters.chunked_prefills == 0 and time.time() < deadline:
            time.sleep(0.0005)
        promoted_at = engine.counters.steps
        engine.reprioritize(future, 0)
        got = future.result(timeout=60).token_ids
        primary.cancel()
    finally:
        engine.close()
    assert engine.counters.chunked_prefills == 1 and got == want
    assert first["step"] - promoted_at <= 3  # 4 rows a step would take 20 steps for the 80 tokens
