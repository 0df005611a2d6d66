"""PrefixCache: which sequences it keeps, which prefix a prompt forks, and what eviction frees — on a
real FlatKVCache (whose slots carry markers), then end to end: decoding with the cache gives exactly
the tokens of decoding without it, while skipping the cached part of each prompt."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spectot.engine.kv_cache import FlatKVCache
from spectot.engine.prefix_cache import PrefixCache
from spectot.engine.runner import ModelRunner
from spectot.spec.decoding import DecodeConfig, Decoder
from spectot.spec.proposers.ngram import NgramProposer
from spectot.spec.sampling import SamplingParams


def make_stream(cache: FlatKVCache, tokens: list[int], fork_of: int | None = None, shared: int = 0) -> int:
    """A stream holding ``tokens``: forked from ``fork_of`` for the first ``shared``, the rest written as markers."""
    sid = cache.new_stream(fork_of)
    if fork_of is not None:
        cache.truncate(sid, shared)
    rest = tokens[shared:]
    start = cache.reserve(len(rest))
    slots = torch.arange(start, start + len(rest))
    cache.buffer[:, slots] = torch.tensor(rest, dtype=cache.dtype)[:, None, None, None]
    cache.hold(sid, slots)
    return sid


def held_tokens(cache: FlatKVCache, sid: int) -> list[int]:
    return cache.buffer[0, cache.slots(sid), 0, 0, 0].long().tolist()


@pytest.fixture
def kv() -> FlatKVCache:
    return FlatKVCache(2, 1, 2, torch.float32, torch.device("cpu"), capacity=8)


def test_fork_reuses_the_longest_prefix_and_holds_exactly_it(kv) -> None:
    prefix = PrefixCache(kv, max_tokens=100, min_match=2)
    prefix.keep(make_stream(kv, [1, 2, 3, 4, 5, 6]), [1, 2, 3, 4, 5, 6])
    prefix.keep(make_stream(kv, [1, 2, 7, 8]), [1, 2, 7, 8])
    sid, n, _ = prefix.fork([1, 2, 3, 4, 9, 9])
    assert n == 4 and held_tokens(kv, sid) == [1, 2, 3, 4]
    sid2, n2, _ = prefix.fork([1, 2, 7, 5])
    assert n2 == 3 and held_tokens(kv, sid2) == [1, 2, 7]
    assert (prefix.hits, prefix.reused_tokens) == (2, 7)
    used = kv.used
    fresh, n3, _ = prefix.fork([9, 9, 9])  # no prefix of length >= min_match
    assert n3 == 0 and kv.length(fresh) == 0 and kv.used == used


def test_keep_stores_only_maximal_sequences(kv) -> None:
    prefix = PrefixCache(kv, max_tokens=100, min_match=2)
    a = make_stream(kv, [1, 2, 3])
    prefix.keep(a, [1, 2, 3])
    b = make_stream(kv, [1, 2, 3, 4, 5], fork_of=a, shared=3)
    prefix.keep(b, [1, 2, 3, 4, 5])  # a is b's prefix: dropped, its slots live on in b
    assert len(prefix) == 1 and prefix.held_tokens == 5 and kv.used == 5
    c = make_stream(kv, [1, 2, 3, 4], fork_of=b, shared=4)
    prefix.keep(c, [1, 2, 3, 4])  # covered by b: released at once
    assert len(prefix) == 1 and kv.used == 5
    prefix.keep(make_stream(kv, [6]), [6])  # shorter than min_match
    assert len(prefix) == 1 and kv.used == 5


def test_eviction_drops_least_recently_used_down_to_three_quarters(kv) -> None:
    prefix = PrefixCache(kv, max_tokens=10, min_match=2)
    for first in (10, 20, 30):
        prefix.keep(make_stream(kv, [first, 1, 2, 3]), [first, 1, 2, 3])
    # 12 > 10 held: evict the oldest down to 10 * 3 // 4 = 7 -> [10 ...] and [20 ...] go
    assert prefix.held_tokens == 4 and len(prefix) == 1
    assert prefix.longest([30, 1, 2, 3])[1] == 4 and prefix.longest([10, 1])[1] == 0
    assert kv.used == 4  # evicted slots are freed
    prefix.clear()
    assert kv.used == 0 and len(prefix) == 0


def test_a_recently_used_entry_survives_eviction(kv) -> None:
    prefix = PrefixCache(kv, max_tokens=12, min_match=2)
    for first in (10, 20, 30):
        prefix.keep(make_stream(kv, [first, 1, 2, 3]), [first, 1, 2, 3])
    kv.release(prefix.fork([10, 1, 2, 9])[0])  # touches [10 ...]
    prefix.keep(make_stream(kv, [40, 1, 2, 3]), [40, 1, 2, 3])  # 16 > 12: evict down to 9
    assert prefix.longest([10, 1, 2, 3])[1] == 4 and prefix.longest([40, 1, 2, 3])[1] == 4
    assert prefix.longest([20, 1, 2, 3])[1] == 0 and prefix.longest([30, 1, 2, 3])[1] == 0


def test_a_long_sequence_stays_and_one_past_the_limit_evicts_nothing(kv) -> None:
    """Kept past 3/4 of the limit, a sequence evicted every other entry and then itself."""
    prefix = PrefixCache(kv, max_tokens=10, min_match=2)
    prefix.keep(make_stream(kv, [10, 1]), [10, 1])
    prefix.keep(make_stream(kv, [20, 1]), [20, 1])
    prefix.keep(make_stream(kv, [30, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), [30, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 11 > 10
    assert len(prefix) == 2 and kv.used == 4  # refused: the others stay
    long = [40, 1, 2, 3, 4, 5, 6, 7, 8]  # 9 tokens: fits, though past 3/4 of the limit
    prefix.keep(make_stream(kv, long), long)
    assert len(prefix) == 1 and prefix.longest(long)[1] == 9 and kv.used == 9


def test_bad_limits_are_refused(kv) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(kv, max_tokens=-1)
    with pytest.raises(ValueError, match="min_match"):
        PrefixCache(kv, min_match=0)


def test_a_stream_kept_under_other_tokens_than_its_kv_is_refused(kv) -> None:
    """keep trusted the caller's tokens: a stream holding the KV of 4 tokens kept as 5 (or 3) was later forked for
    prompts it holds no KV of (or the KV of other positions), and decoding went on from wrong keys in silence."""
    prefix = PrefixCache(kv, max_tokens=100, min_match=2)
    for tokens in ([1, 2, 3, 4, 5], [1, 2, 3]):
        sid = make_stream(kv, [1, 2, 3, 4])
        with pytest.raises(ValueError, match=f"holds the KV of 4 tokens, not of {len(tokens)}"):
            prefix.keep(sid, tokens)
        assert sid not in kv.streams and len(prefix) == 0  # released: nothing leaks
    assert kv.used == 0


# -- end to end: a search's prompts extend what ran before ------------------------------------------
PROMPT = [3, 17, 42, 8, 21, 9, 60, 2, 2, 14, 33, 7, 50, 11, 38, 5, 19, 23]  # 18 tokens: above MIN_SHARED_PREFIX


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=1.0)])
def test_children_prompts_fork_their_parents_kv_and_decode_identically(tiny_llama, sampling) -> None:
    """Parent -> its sequence + 2 tokens -> a child prompt: with the cache the child's prompt is mostly
    reused (hits, reused tokens) and every token equals decoding without any cache (fp32, same seeds)."""
    target = tiny_llama()
    config = DecodeConfig(max_new_tokens=12, sampling=sampling)

    def search(cache_tokens: int) -> tuple[list[list[int]], int, int]:
        decoder = Decoder(ModelRunner(target), prefix_cache_tokens=cache_tokens)
        outputs, prompt = [], PROMPT
        with decoder.session([], config) as session:
            for depth in range(3):
                streams = session.add([prompt, prompt[:-1] + [44]], config, [depth, depth + 100])
                session.prefill(streams)
                while any(s.finish is None for s in streams):
                    active = [s for s in streams if s.finish is None]
                    session.verify(active, session.propose(active))
                outputs += [s.generated for s in streams]
                prompt = prompt + streams[0].generated + [4, 6]  # the child's prompt extends its parent
                for s in streams:
                    session.release(s)
            cache = session.prefix_cache
            return outputs, cache.hits, cache.reused_tokens, session.prefilled_tokens

    plain, no_hits, _, prefilled_plain = search(0)
    cached, hits, reused, prefilled = search(4096)
    assert no_hits == 0
    assert hits >= 4 and reused >= 4 * len(PROMPT)
    assert prefilled < prefilled_plain / 2  # here 31 prompt tokens run instead of 99
    assert cached == plain


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=1.0)])
def test_the_cache_outlives_a_call_and_decoders_over_one_runner_share_it(tiny_llama, sampling) -> None:
    """A search's next level is a new call, often by another engine (ar for values, sd for thoughts):
    it forks what the last call ran, and decodes exactly as a decoder that never saw it (fp32)."""
    target = tiny_llama()
    config = DecodeConfig(max_new_tokens=10, sampling=sampling, seed=3)
    runner = ModelRunner(target)
    first = Decoder(runner)
    second = Decoder(runner, proposer=NgramProposer(), prefix_cache=first.prefix_cache)
    [parent] = first.generate([PROMPT], config)
    child = PROMPT + parent.token_ids + [4, 6]
    sd = replace(config, method="sd", num_draft_tokens=3)
    with second.session([child], sd) as session:
        session.prefill(session.streams)
        while session.streams[0].finish is None:
            session.verify(session.streams, session.propose(session.streams))
    assert session.cached_tokens >= len(PROMPT) + len(parent.token_ids) - 1
    assert session.prefilled_tokens <= 3
    fresh = Decoder(ModelRunner(target), proposer=NgramProposer(), prefix_cache_tokens=0)
    alone = fresh.generate([child], sd)[0]
    assert session.results()[0].token_ids == alone.token_ids
    assert first.prefix_cache.held_tokens >= len(child)  # the child's sequence is kept for the next call
    first.prefix_cache.clear()
    assert runner.cache.used == 0  # nothing held outside the cache
    with pytest.raises(ValueError, match="runner"):
        Decoder(ModelRunner(target), prefix_cache=first.prefix_cache)


def test_an_error_mid_call_releases_its_streams_instead_of_caching_them(tiny_llama) -> None:
    """Only KV that finished forwards wrote is kept: the prompt (prefilled before the error), not the
    stream that was mid-decode."""
    decoder = Decoder(ModelRunner(tiny_llama()))
    with pytest.raises(RuntimeError, match="boom"):
        with decoder.session([PROMPT], DecodeConfig(max_new_tokens=8)) as session:
            session.prefill(session.streams)
            session.verify(session.streams, session.propose(session.streams))
            raise RuntimeError("boom")
    assert decoder.prefix_cache.held_tokens == len(PROMPT)
    decoder.prefix_cache.clear()
    assert decoder.runner.cache.used == 0


def test_a_prefill_that_fails_gives_back_every_slot(tiny_llama, monkeypatch) -> None:
    """A forward that raises (out of memory, an interrupt) frees its reserved slots and the prompts' forks:
    nothing is held once the cache is cleared, call after call."""
    target = tiny_llama()
    decoder = Decoder(ModelRunner(target))
    good, other = PROMPT + [4], PROMPT + [5]

    forward = decoder.runner._forward_reserved

    def out_of_memory(trees, *args, **kwargs):  # the prompts' forward, after their shared prefix's succeeded
        if len(trees) > 1:
            raise MemoryError("out of memory")
        return forward(trees, *args, **kwargs)

    for _ in range(3):
        with monkeypatch.context() as patch:
            patch.setattr(decoder.runner, "_forward_reserved", out_of_memory)
            with pytest.raises(MemoryError):
                decoder.generate([good, other], DecodeConfig(max_new_tokens=4))
        decoder.prefix_cache.clear()
        assert decoder.runner.cache.used == 0
    want = Decoder(ModelRunner(target), prefix_cache_tokens=0).generate([good], DecodeConfig(max_new_tokens=6))[0]
    assert decoder.generate([good], DecodeConfig(max_new_tokens=6))[0].token_ids == want.token_ids


def test_hidden_states_travel_with_their_entries_and_only_to_forks_that_ask_for_their_layer(kv) -> None:
    prefix = PrefixCache(kv, max_tokens=100, min_match=2)
    hidden = torch.arange(5.0)[:, None].expand(5, 3)  # one row per token
    prefix.keep(make_stream(kv, [1, 2, 3, 4, 5]), [1, 2, 3, 4, 5], hidden, hidden_layer=-4)
    prefix.keep(make_stream(kv, [7, 8, 9]), [7, 8, 9])  # no hidden states
    sid, n, rows = prefix.fork([1, 2, 3, 9], hidden_layer=-4)
    assert n == 3 and held_tokens(kv, sid) == [1, 2, 3] and rows.equal(hidden[:3])
    assert prefix.fork([1, 2, 3, 9], hidden_layer=-2).length == 0  # another layer's states are no use
    assert prefix.fork([7, 8, 9, 1], hidden_layer=-4).length == 0  # kept without any
    plain = prefix.fork([7, 8, 1])
    assert plain.length == 2 and plain.hidden is None
    # an entry with hidden states is not "covered" by a longer one without them
    prefix.keep(make_stream(kv, [7, 8]), [7, 8], hidden[:2], hidden_layer=-4)
    assert prefix.fork([7, 8, 5], hidden_layer=-4).length == 2
    # nor replaced by a longer entry without them (an EDD fork found nothing after a plain run kept its text)
    prefix.keep(make_stream(kv, [7, 8, 9, 9]), [7, 8, 9, 9])
    assert prefix.fork([7, 8, 5], hidden_layer=-4).length == 2
    refused = make_stream(kv, [6, 6, 6])
    with pytest.raises(ValueError, match="one row per token"):
        prefix.keep(refused, [6, 6, 6], hidden[:2], hidden_layer=-4)
    assert refused not in kv.streams  # released even so: a refused keep leaked the caller's stream
