"""FlatKVCache: shared slots with reference counts, freeing, dense removal and capacity growth.

Each slot's keys and values are filled with a marker (the slot's original index + 1, values
negated) so a test can tell where every slot's contents went.
"""

from __future__ import annotations

import pytest
import torch

from spectot.engine.kv_cache import FlatKVCache

LAYERS, HEADS, DIM = 2, 2, 3


def make_cache(capacity: int = 16) -> FlatKVCache:
    return FlatKVCache(LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"), capacity=capacity)


def write(cache: FlatKVCache, n: int, first_marker: int) -> torch.Tensor:
    """Reserve n tail slots and fill them with markers first_marker, first_marker + 1, ...; return them."""
    start = cache.reserve(n)
    slots = torch.arange(start, start + n)
    for i, slot in enumerate(slots.tolist()):
        cache.buffer[:, slot, 0] = first_marker + i
        cache.buffer[:, slot, 1] = -(first_marker + i)
    return slots


def markers(cache: FlatKVCache, slots: torch.Tensor) -> list[int]:
    """The marker held by each slot, after checking keys and values agree in every layer and head."""
    keys = cache.buffer[:, slots, 0]  # (L, n, H, D)
    values = cache.buffer[:, slots, 1]
    assert torch.equal(keys, -values)
    assert torch.equal(keys, keys[:1, :, :1, :1].expand_as(keys))
    return keys[0, :, 0, 0].long().tolist()


def test_new_slots_are_reserved_at_the_tail() -> None:
    cache = make_cache()
    assert cache.reserve(3) == 0
    assert cache.reserve(2) == 3
    assert cache.used == 5


def test_hold_appends_and_counts() -> None:
    cache = make_cache()
    a = cache.new_stream()
    slots = write(cache, 3, first_marker=1)
    cache.hold(a, slots)
    assert cache.slots(a).tolist() == [0, 1, 2]
    assert cache.length(a) == 3
    assert cache.refcount[:3].tolist() == [1, 1, 1]
    assert markers(cache, cache.slots(a)) == [1, 2, 3]


def test_fork_shares_slots_and_counts_references() -> None:
    cache = make_cache()
    a = cache.new_stream()
    cache.hold(a, write(cache, 3, first_marker=1))
    b = cache.new_stream(fork_of=a)
    assert b != a
    assert cache.slots(b).tolist() == [0, 1, 2]
    assert cache.used == 3  # nothing copied
    assert cache.refcount[:3].tolist() == [2, 2, 2]
    # The fork's path is its own: growing b does not grow a.
    cache.hold(b, write(cache, 1, first_marker=4))
    assert cache.slots(a).tolist() == [0, 1, 2]
    assert cache.slots(b).tolist() == [0, 1, 2, 3]


def test_truncate_frees_only_unshared_slots() -> None:
    cache = make_cache()
    a = cache.new_stream()
    cache.hold(a, write(cache, 3, first_marker=1))
    b = cache.new_stream(fork_of=a)
    cache.hold(b, write(cache, 2, first_marker=4))  # b = [0, 1, 2, 3, 4]
    cache.hold(a, write(cache, 1, first_marker=6))  # a = [0, 1, 2, 5]

    cache.truncate(b, 2)  # drops shared slot 2 and b's own slots 3, 4
    assert cache.slots(b).tolist() == [0, 1]
    assert cache.used == 4  # slot 2 is still a's; 3 and 4 were freed, so a's slot 5 moved to 3
    assert cache.slots(a).tolist() == [0, 1, 2, 3]
    assert markers(cache, cache.slots(a)) == [1, 2, 3, 6]
    assert cache.refcount[:4].tolist() == [2, 2, 1, 1]

    cache.truncate(b, 5)  # longer than the stream: nothing happens
    assert cache.slots(b).tolist() == [0, 1]
    assert cache.used == 4
    with pytest.raises(ValueError, match="keeps >= 0 tokens, got -1"):  # it dropped a slot and kept length -1
        cache.truncate(b, -1)
    assert cache.slots(b).tolist() == [0, 1] and cache.length(b) == 2


def test_truncating_a_streams_tail_slots_frees_them_unless_another_stream_holds_them() -> None:
    cache = make_cache()
    a = cache.new_stream()
    cache.hold(a, write(cache, 3, first_marker=1))
    cache.hold(a, write(cache, 2, first_marker=10).flip(0))  # a's last two entries: the tail, out of order
    cache.truncate(a, 3)
    assert cache.used == 3 and cache.slots(a).tolist() == [0, 1, 2] and cache.refcount[:5].tolist() == [1, 1, 1, 0, 0]
    b = cache.new_stream(fork_of=a)
    cache.hold(a, write(cache, 2, first_marker=20))  # a = [0, 1, 2, 3, 4], b holds slot 4 too
    cache.hold(b, torch.tensor([4]))
    cache.truncate(a, 3)  # slot 3 goes, slot 4 stays b's (and shifts down to 3)
    assert (
        cache.used == 4 and cache.slots(b).tolist() == [0, 1, 2, 3] and markers(cache, cache.slots(b)) == [1, 2, 3, 21]
    )


def test_keep_tail_moves_a_verified_paths_rows_down_and_drops_the_rest() -> None:
    cache = make_cache()
    a = cache.new_stream()
    cache.hold(a, write(cache, 2, first_marker=1))
    write(cache, 6, first_marker=10)  # one forward's tree: slots 2-7
    cache.keep_tail(a, 2, [0, 2, 5])  # its docstring's example: slot 4 -> 3, slot 7 -> 4
    assert cache.used == 5 and cache.slots(a).tolist() == [0, 1, 2, 3, 4]
    assert markers(cache, cache.slots(a)) == [1, 2, 10, 12, 15] and cache.refcount[:5].tolist() == [1] * 5


def test_release_frees_only_unshared_slots() -> None:
    cache = make_cache()
    a = cache.new_stream()
    cache.hold(a, write(cache, 3, first_marker=1))
    b = cache.new_stream(fork_of=a)
    cache.hold(b, write(cache, 2, first_marker=4))  # b = [0, 1, 2, 3, 4]

    cache.release(a)
    assert cache.used == 5  # every slot of a is shared with b
    assert cache.refcount[:5].tolist() == [1, 1, 1, 1, 1]
    assert markers(cache, cache.slots(b)) == [1, 2, 3, 4, 5]

    cache.release(b)
    assert cache.used == 0
    assert cache.streams == {}
    assert int(cache.refcount.sum()) == 0


def test_remove_docstring_example() -> None:
    # A holds the prompt in slots [0, 1, 2]; B = fork(A); a forward appends a 2-node tree to A
    # (slots 3, 4) and a 1-node tree to B (slot 5). A accepts only its root, B its root: slot 4 is
    # removed, slot 5 shifts to 4, and A = [0, 1, 2, 3], B = [0, 1, 2, 4].
    cache = make_cache()
    a = cache.new_stream()
    cache.hold(a, write(cache, 3, first_marker=1))
    b = cache.new_stream(fork_of=a)
    new = write(cache, 3, first_marker=4)  # slots 3, 4, 5 hold markers 4, 5, 6
    cache.hold(a, new[:1])
    cache.hold(b, new[2:])
    cache.remove(new[1:2])

    assert cache.slots(a).tolist() == [0, 1, 2, 3]
    assert cache.slots(b).tolist() == [0, 1, 2, 4]
    assert cache.used == 5
    assert markers(cache, cache.slots(a)) == [1, 2, 3, 4]
    assert markers(cache, cache.slots(b)) == [1, 2, 3, 6]
    assert cache.refcount[:6].tolist() == [2, 2, 2, 1, 1, 0]


def test_remove_scattered_slots_keeps_the_buffer_dense() -> None:
    cache = make_cache()
    streams = [cache.new_stream() for _ in range(3)]
    new = write(cache, 9, first_marker=1)  # markers 1..9 in slots 0..8
    # stream 0 keeps slots 0, 3, 6; stream 1 keeps 2, 5; stream 2 keeps 8; 1, 4, 7 are dropped
    cache.hold(streams[0], new[[0, 3, 6]])
    cache.hold(streams[1], new[[2, 5]])
    cache.hold(streams[2], new[[8]])
    cache.remove(new[[1, 4, 7]])

    assert cache.used == 6
    assert sorted(torch.cat([cache.slots(s) for s in streams]).tolist()) == list(range(6))
    assert markers(cache, cache.slots(streams[0])) == [1, 4, 7]
    assert markers(cache, cache.slots(streams[1])) == [3, 6]
    assert markers(cache, cache.slots(streams[2])) == [9]
    assert cache.refcount[:6].tolist() == [1] * 6
    assert int(cache.refcount[6:].sum()) == 0


def test_remove_nothing_is_a_no_op() -> None:
    cache = make_cache()
    a = cache.new_stream()
    cache.hold(a, write(cache, 2, first_marker=1))
    cache.remove(torch.empty(0, dtype=torch.int64))
    assert cache.used == 2
    assert markers(cache, cache.slots(a)) == [1, 2]


def test_capacity_growth_preserves_contents() -> None:
    cache = make_cache(capacity=4)
    a = cache.new_stream()
    cache.hold(a, write(cache, 3, first_marker=1))
    b = cache.new_stream(fork_of=a)

    new = write(cache, 6, first_marker=4)  # needs 9 slots in a 4-slot cache
    assert cache.capacity >= 9
    assert cache.buffer.shape == (LAYERS, cache.capacity, 2, HEADS, DIM)
    assert cache.refcount.shape == (cache.capacity,)
    assert cache.used == 9
    assert markers(cache, cache.slots(a)) == [1, 2, 3]
    assert cache.refcount[:3].tolist() == [2, 2, 2]

    cache.hold(b, new)
    assert markers(cache, cache.slots(b)) == list(range(1, 10))


def test_long_stream_paths_grow() -> None:
    cache = make_cache(capacity=8)
    a = cache.new_stream()
    for i in range(100):  # longer than a stream's initial slot list (64)
        cache.hold(a, write(cache, 1, first_marker=i + 1))
    assert cache.length(a) == 100
    assert cache.slots(a).tolist() == list(range(100))
    assert markers(cache, cache.slots(a)) == list(range(1, 101))
    b = cache.new_stream(fork_of=a)
    assert cache.slots(b).tolist() == list(range(100))


def test_deep_frees_leave_holes_until_half_the_buffer_then_one_shift_removes_them(monkeypatch) -> None:
    """A released stream far below the tail is not shifted over at once (that costs O(used) per
    release); its slots become holes. Later tail removals, reservations and the half-full rule
    compact them, and every live stream keeps reading its own keys and values throughout."""
    import spectot.engine.kv_cache as kv

    monkeypatch.setattr(kv, "SHIFT_SLOTS", 2)
    cache = make_cache(capacity=32)
    a, b, c = (cache.new_stream() for _ in range(3))
    cache.hold(a, write(cache, 3, first_marker=1))  # slots 0-2
    cache.hold(b, write(cache, 3, first_marker=4))  # slots 3-5
    cache.hold(c, write(cache, 4, first_marker=7))  # slots 6-9
    cache.release(a)  # 7 slots above it: holes
    assert (cache.used, cache.holes) == (10, 3)
    assert cache.hole[:10].tolist() == [True] * 3 + [False] * 7
    assert markers(cache, cache.slots(b)) == [4, 5, 6] and markers(cache, cache.slots(c)) == [7, 8, 9, 10]

    cache.release(b)  # 6 of 10 used slots are holes now: one shift
    assert (cache.used, cache.holes) == (4, 0)
    assert cache.slots(c).tolist() == [0, 1, 2, 3] and markers(cache, cache.slots(c)) == [7, 8, 9, 10]

    d = cache.new_stream(fork_of=c)
    cache.hold(d, write(cache, 4, first_marker=11))  # slots 4-7
    e = cache.new_stream()
    cache.hold(e, write(cache, 1, first_marker=15))  # slot 8
    cache.truncate(d, 5)  # drops slots 5-7 (deep: 3 above slot 5 ... > SHIFT_SLOTS): holes
    assert cache.holes == 3
    tail = write(cache, 2, first_marker=16)  # slots 9, 10
    cache.remove(tail[1:])  # near the tail: shifted at once, the holes at or above it with it
    assert cache.holes == 3 and cache.used == 10
    cache.hold(e, tail[:1])
    assert markers(cache, cache.slots(d)) == [7, 8, 9, 10, 11] and markers(cache, cache.slots(e)) == [15, 16]

    cache.reserve(cache.capacity - cache.used + 1)  # would grow: the holes go first
    assert cache.holes == 0
    assert markers(cache, cache.slots(d)) == [7, 8, 9, 10, 11] and markers(cache, cache.slots(e)) == [15, 16]


def test_drop_tail_frees_a_scratch_forward_and_refuses_held_slots() -> None:
    cache = make_cache()
    sid = cache.new_stream()
    cache.hold(sid, write(cache, 3, 1))
    write(cache, 2, 10)  # a forward's rows nobody keeps
    cache.drop_tail(3)
    assert cache.used == 3 and markers(cache, cache.slots(sid)) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="still held"):
        cache.drop_tail(2)
    assert cache.used == 3


@pytest.mark.parametrize("shift_slots", [2, 256])
def test_random_forks_holds_truncations_and_releases_keep_every_stream_reading_its_own_tokens(
    monkeypatch, shift_slots: int
) -> None:
    """Against a plain list of markers per stream: after every operation each live stream reads exactly its
    tokens in order, and the highest slot a shift consults (``top``) is its path's maximum."""
    import random

    import spectot.engine.kv_cache as kv

    monkeypatch.setattr(kv, "SHIFT_SLOTS", shift_slots)
    rng = random.Random(0)
    cache = make_cache(capacity=8)
    expected: dict[int, list[int]] = {}
    marker = 1
    for _ in range(400):
        op = rng.random()
        if op < 0.15 or not expected:
            parent = rng.choice([None, *expected]) if expected else None
            sid = cache.new_stream(fork_of=parent)
            expected[sid] = [] if parent is None else list(expected[parent])
        elif op < 0.55:  # a forward appends a few tokens to some streams and keeps a prefix of each
            chosen = rng.sample(list(expected), min(len(expected), rng.randint(1, 3)))
            sizes = [rng.randint(1, 3) for _ in chosen]
            written = dict(zip(chosen, write(cache, sum(sizes), marker).split(sizes)))  # one reserve, as a forward
            keep = torch.zeros(cache.used, dtype=torch.bool)
            for sid, slots in written.items():
                kept = slots[: rng.randint(0, slots.numel())]
                cache.hold(sid, kept)
                keep[kept] = True
                expected[sid] += list(range(marker, marker + kept.numel()))
                marker += slots.numel()
            first = int(min(s.min() for s in written.values()))
            cache.remove((~keep[first:]).nonzero().squeeze(1) + first)  # the forward's rejected rows
        elif op < 0.75:
            sid = rng.choice(list(expected))
            length = rng.randint(0, len(expected[sid]))
            cache.truncate(sid, length)
            expected[sid] = expected[sid][:length]
        else:
            sid = rng.choice(list(expected))
            cache.release(sid)
            del expected[sid]
        for sid, tokens in expected.items():
            slots = cache.slots(sid)
            assert markers(cache, slots) == tokens
            assert cache.streams[sid].top == (int(slots.max()) if slots.numel() else -1)
