"""The flat KV cache: one slot array shared by every stream, a search tree of token paths.

All streams of a model live in one key/value buffer of ``capacity`` slots. A *stream* is a
root-to-leaf path through that buffer: the ordered list of slots holding its tokens. Forking a
stream copies the list, not the keys, so the n thoughts of a Tree-of-Thoughts level share their
prompt's KV once (reference counts say when a slot is free).

New tokens are always written at the tail (slots ``used .. used + N - 1``). Removing slots near
the tail (the rejected nodes of a verified tree, a truncated draft) shifts the few later slots
down, so the buffer stays dense. Slots freed deeper down (a released stream, an evicted prefix)
become *holes*, left in place: shifting the whole tail on every finished stream cost O(used) each
time (8% of a REBASE run's time). Once holes make up more than half of the used slots, or the buffer would
grow, one shift removes them all. A stream's view of the buffer is exactly what prefilling its
tokens would give either way: holes are held by no stream.

Worked example: stream A holds the prompt in slots [0, 1, 2]; B = fork(A); a forward appends a
2-node tree to A (slots 3, 4) and a 1-node tree to B (slot 5). A accepts only its root, B its root:
slot 4 is removed, slot 5 shifts to 4, and A = [0, 1, 2, 3], B = [0, 1, 2, 4].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


SHIFT_SLOTS = 256  # freed slots this close to the tail are shifted away at once (a verified tree's rejects)


@dataclass
class _Stream:
    slots: torch.Tensor  # (capacity_s,) int64; the first `length` entries are the path
    length: int = 0
    top: int = -1  # its highest slot (-1: none), so a shift passes over the streams below it without a look

    def view(self) -> torch.Tensor:
        return self.slots[: self.length]

    def reserve(self, need: int) -> None:
        """Room for ``need`` path entries (the buffer at least doubles when it grows)."""
        if need > self.slots.numel():
            grown = torch.empty(max(need, 2 * self.slots.numel()), dtype=torch.int64)
            grown[: self.length] = self.view()
            self.slots = grown

    def append(self, new_slots: torch.Tensor) -> None:
        if new_slots.numel() == 0:
            return
        need = self.length + new_slots.numel()
        self.reserve(need)
        self.slots[self.length : need] = new_slots
        self.length = need
        self.top = max(self.top, int(new_slots.max()))

    def append_range(self, first: int, n: int) -> None:
        """append(arange(first, first + n)) without the index tensor where n == 1."""
        if n == 1:
            self.reserve(self.length + 1)
            self.slots[self.length] = first
            self.length += 1
            self.top = max(self.top, first)
        elif n:
            self.append(torch.arange(first, first + n))

    def cut(self, length: int) -> None:
        self.length = length
        self.top = int(self.view().max()) if length else -1


@dataclass
class FlatKVCache:
    """Keys and values of every layer, slot-major: ``buffer[layer, slot]`` is (2, H_kv, D), keys then
    values, so gathering a stream's slots copies whole contiguous rows."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    capacity: int = 1024
    used: int = 0
    buffer: torch.Tensor = field(init=False)  # (L, capacity, 2, H_kv, D)
    refcount: torch.Tensor = field(init=False)  # (capacity,) int32: streams holding each slot
    hole: torch.Tensor = field(init=False)  # (capacity,) bool: freed below the tail, not yet shifted away
    holes: int = 0
    streams: dict[int, _Stream] = field(init=False, default_factory=dict)
    _next_id: int = 0

    def __post_init__(self) -> None:
        self.buffer = torch.zeros(self._shape(self.capacity), dtype=self.dtype, device=self.device)
        self.refcount = torch.zeros(self.capacity, dtype=torch.int32)
        self.hole = torch.zeros(self.capacity, dtype=torch.bool)

    def _shape(self, capacity: int) -> tuple[int, ...]:
        return (self.num_layers, capacity, 2, self.num_kv_heads, self.head_dim)

    # -- streams ---------------------------------------------------------------------------
    def new_stream(self, fork_of: int | None = None) -> int:
        sid, self._next_id = self._next_id, self._next_id + 1
        stream = _Stream(torch.empty(64, dtype=torch.int64))
        if fork_of is not None:
            parent = self.streams[fork_of].view()
            stream.append(parent)
            self.refcount[parent] += 1
        self.streams[sid] = stream
        return sid

    def length(self, sid: int) -> int:
        return self.streams[sid].length

    def slots(self, sid: int) -> torch.Tensor:
        return self.streams[sid].view()

    def path_with(self, sid: int, slot: int) -> torch.Tensor:
        """The stream's slots followed by ``slot``, as a view of its path buffer: the entry past the path's end is
        scratch until ``hold`` writes it for good (the same value, for a kept one-row step), so a one-row
        forward's attention columns need no copy. Use the view before the stream changes."""
        stream = self.streams[sid]
        stream.reserve(stream.length + 1)
        stream.slots[stream.length] = slot
        return stream.slots[: stream.length + 1]

    def truncate(self, sid: int, length: int) -> None:
        """Drop a stream's tokens after ``length`` (a rollback); slots nobody holds are freed."""
        if length < 0:  # cut(-1) dropped the last slot and left a length of -1
            raise ValueError(f"a stream keeps >= 0 tokens, got {length}")
        stream = self.streams[sid]
        if length >= stream.length:
            return
        dropped = stream.view()[length:].clone()
        stream.cut(length)
        self._release_slots(dropped)

    def release(self, sid: int) -> None:
        self._release_slots(self.streams.pop(sid).view().clone())

    def _release_slots(self, slots: torch.Tensor) -> None:
        first = self.used - slots.numel()
        # distinct slots none below used - (their count) are the buffer's tail (a draft's kept chain); held by the
        # releasing stream alone, they go as the tail, without index tensors (~50 us of a draft step)
        if slots.numel() and int(slots.min()) == first and bool((self.refcount[first : self.used] == 1).all()):
            self.refcount[first : self.used] = 0
            self.used = first
            return
        self.refcount[slots] -= 1
        self.remove(slots[self.refcount[slots] == 0])

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values as (H_kv, capacity, D) views."""
        return self.buffer[layer].permute(1, 2, 0, 3).unbind(0)

    # -- slots -----------------------------------------------------------------------------
    def reserve(self, n: int) -> int:
        """Make room for n tail slots; returns the first one. The caller writes and then keeps
        (``hold``) or drops (``remove``) each of them."""
        if self.used + n > self.capacity and self.holes:
            self._shift(self.hole[: self.used].nonzero().squeeze(1))
        if self.used + n > self.capacity:
            capacity = max(self.used + n, 2 * self.capacity)
            grown = torch.zeros(self._shape(capacity), dtype=self.dtype, device=self.device)
            grown[:, : self.used] = self.buffer[:, : self.used]
            self.buffer = grown
            refcount = torch.zeros(capacity, dtype=torch.int32)
            refcount[: self.used] = self.refcount[: self.used]
            self.refcount = refcount
            self.hole = torch.zeros(capacity, dtype=torch.bool)  # none are left: the shift above took them
            self.capacity = capacity
        start = self.used
        self.used += n
        return start

    def hold(self, sid: int, slots: torch.Tensor) -> None:
        """Append already-written slots to a stream's path."""
        self.streams[sid].append(slots)
        self.refcount[slots] += 1

    def hold_range(self, sid: int, first: int, n: int) -> None:
        """``hold`` of the consecutive slots first .. first + n - 1 (a prefill, an AR step, a kept chain), by
        slices rather than index tensors."""
        self.streams[sid].append_range(first, n)
        self.refcount[first : first + n] += 1

    def keep_tail(self, sid: int, start: int, rows: Sequence[int]) -> None:
        """The tail from ``start`` holds one forward's new slots, all of them ``sid``'s and held by none yet: append
        its ``rows`` (ascending offsets from ``start``, a verified tree's accepted path) to the stream, their keys
        and values moved down to ``start``, ``start + 1``, ... over the rejected ones, and drop the rest. One
        copy of the few moved rows instead of a shift of the tail (~0.25 ms of a verified tree's commit).

        Example: rows [0, 2, 5] from start 10: slot 12 -> 11, 15 -> 12; the stream gains [10, 11, 12]."""
        moved = [(start + i, start + row) for i, row in enumerate(rows) if row != i]
        if moved:
            dst, src = torch.tensor(moved).T
            self.buffer[:, dst] = self.buffer[:, src]
        self.hold_range(sid, start, len(rows))
        self.drop_tail(start + len(rows), check=False)

    def drop_tail(self, start: int, check: bool = True) -> None:
        """Delete the tail slots ``start..used``, reserved and held by no stream (a scratch forward); ``check``
        False skips verifying that (a caller that held none of them, at ~30 us a draft step saved)."""
        if check and bool(self.refcount[start : self.used].any()):
            raise RuntimeError(f"tail slots from {start} are still held by a stream")
        self.used = start

    def remove(self, slots: torch.Tensor) -> None:
        """Delete slots nobody holds: near the tail by shifting the later slots down, deeper ones
        as holes (shifted away together once they are half the buffer)."""
        if slots.numel() == 0:
            return
        first = int(slots.min())  # host sync
        if first + slots.numel() == self.used:  # distinct slots from ``first`` on: exactly the tail (a draft's
            self.used = first  # scratch nodes, a truncated stream's last tokens); no hole lies among them
            self.refcount[first:] = 0
            return
        if self.used - first <= SHIFT_SLOTS:  # every verified forward's rejects: keep it cheap
            if self.holes:  # holes above ``first`` go with them
                slots = torch.cat([slots, self.hole[first : self.used].nonzero().squeeze(1) + first])
            self._shift(slots)
            return
        self.hole[slots] = True
        self.holes += slots.numel()
        if 2 * self.holes > self.used:
            self._shift(self.hole[: self.used].nonzero().squeeze(1))

    def _shift(self, slots: torch.Tensor) -> None:
        """Drop ``slots`` (holes among them) and move every later slot down over them."""
        if slots.numel() == 0:
            return
        gone = torch.zeros(self.used, dtype=torch.bool)
        gone[slots] = True
        first = int(slots.min())
        if self.holes:
            self.holes -= int(self.hole[slots].sum())
            self.hole[slots] = False
        keep = (~gone[first:]).nonzero().squeeze(1) + first  # (kept after first,)
        n_keep = keep.numel()
        if not n_keep:  # the whole tail goes (a draft's scratch rows): no stream holds any of it
            self.used = first
            self.refcount[first:] = 0
            return
        self.buffer[:, first : first + n_keep] = self.buffer[:, keep]
        self.refcount[first : first + n_keep] = self.refcount[keep]
        if self.holes:  # the holes left move down with their slots (without any, the mask is all False)
            self.hole[first : first + n_keep] = self.hole[keep]
        shift = torch.cumsum(gone, 0)  # slot j moves to j - shift[j]
        for stream in self.streams.values():
            if stream.top >= first:  # kept prefixes and finished paths lie below the tail: untouched
                path = stream.view()
                path -= shift[path]
                stream.top -= int(shift[stream.top])
        self.used = first + n_keep
        self.refcount[self.used :] = 0
        if self.holes:
            self.hole[self.used :] = False
