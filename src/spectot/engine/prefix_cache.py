"""The prefix cache: KV of finished token sequences, kept so later prompts that start with them skip
prefilling that part (SGLang's radix cache, over the flat KV cache's forkable streams).

A tree search asks for a node's children with the node's own prompt + step as their prompt, so
almost every prompt of a search extends a sequence the engine has already run. When a stream
finishes, its KV stays here under its tokens; a new prompt forks the entry with the longest common
prefix and prefills only the rest. Only whole-token prefixes at the same positions are reused, so the
KV is exactly what prefilling the prompt would give (the runner's kernels are batch-invariant).

Entries are the *maximal* sequences kept: keeping a sequence drops the entries that are prefixes of
it (their slots stay shared through the forks), and a sequence that is a prefix of an entry is not
kept. Past ``max_tokens`` (the sum of entry lengths: an upper bound on the slots held) the least
recently used entries go, down to 3/4 of it, so eviction's slot shifting happens in batches.

An entry may also carry the target's hidden states of one layer at its tokens (what an EDD draft
reads for every token it drafts after): ``fork(tokens, hidden_layer=i)`` matches only entries kept
with layer i's states and hands back the prefix's rows.

Worked example (``min_match`` <= 4; the default asks for 16 common tokens): keep A = [1 2 3 4 5 6]; prompt
[1 2 3 4 9] forks A truncated to 4 tokens and runs only [9]; keep B = [1 2 3 4 5 6 7 8] then replaces A (A is
B's prefix). An entry with hidden states is not replaced by a longer one without them (or with another layer's):
the two are kept side by side, so an EDD draft's fork still finds its rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch


class _Streams(Protocol):  # the part of ModelRunner the cache uses
    def new_stream(self, fork_of: int | None = None) -> int: ...
    def release(self, stream: int) -> None: ...
    def truncate(self, stream: int, length: int) -> None: ...
    def length(self, stream: int) -> int: ...


class Fork(NamedTuple):
    sid: int  # a new stream
    length: int  # tokens of the prefix whose KV it holds (0: none)
    hidden: torch.Tensor | None  # (length, H): their hidden states, when asked for a layer's and length > 0


class PrefixCache:
    def __init__(self, streams: _Streams, max_tokens: int = 16384, min_match: int = 16) -> None:
        if max_tokens < 0 or min_match < 1:
            raise ValueError(f"max_tokens must be >= 0 and min_match >= 1, got {max_tokens} and {min_match}")
        self.streams, self.max_tokens, self.min_match = streams, max_tokens, min_match
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()  # stream -> its tokens, least recent first
        self._hidden: dict[int, tuple[int, torch.Tensor]] = {}  # stream -> (layer, hidden states of its tokens)
        self.held_tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, tokens: Sequence[int], hidden_layer: int | None = None) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that prefix's length (None, 0 if none);
        with ``hidden_layer``, among the entries that carry that layer's hidden states."""
        query = np.asarray(tokens, dtype=np.int64)
        best, best_len = None, 0
        for sid, held in self._entries.items():
            if hidden_layer is not None and self._hidden.get(sid, (None,))[0] != hidden_layer:
                continue
            n = min(len(held), len(query))
            differ = np.flatnonzero(held[:n] != query[:n])
            common = int(differ[0]) if differ.size else n
            if common > best_len:
                best, best_len = sid, common
        return best, best_len

    def fork(self, tokens: Sequence[int], hidden_layer: int | None = None) -> Fork:
        """A new stream holding the KV of the longest cached prefix of ``tokens`` (at least
        ``min_match`` tokens, else none), with that prefix's hidden states of ``hidden_layer`` if
        asked for (only entries kept with them match). The caller prefills the rest."""
        source, length = self.longest(tokens, hidden_layer)
        if source is None or length < self.min_match:
            return Fork(self.streams.new_stream(), 0, None)
        self._entries.move_to_end(source)
        sid = self.streams.new_stream(fork_of=source)
        self.streams.truncate(sid, length)
        self.hits += 1
        self.reused_tokens += length
        return Fork(sid, length, None if hidden_layer is None else self._hidden[source][1][:length])

    def keep(
        self, sid: int, tokens: Sequence[int], hidden: torch.Tensor | None = None, hidden_layer: int | None = None
    ) -> None:
        """Take over stream ``sid``, whose KV holds exactly ``tokens`` (and ``hidden``: the hidden
        states of ``hidden_layer`` at them, for drafts that read them); it is released when evicted, or at once
        when not kept (also when the arguments are refused)."""
        held = np.asarray(tokens, dtype=np.int64)
        length = self.streams.length(sid)
        if length != len(held):  # its KV would be handed out as that of other tokens
            self.streams.release(sid)  # taken over even so: the caller's stream is never left to leak
            raise ValueError(f"stream {sid} holds the KV of {length} tokens, not of {len(held)}")
        if hidden is not None and (hidden_layer is None or len(hidden) != len(held)):
            self.streams.release(sid)
            raise ValueError(f"hidden states need their layer and one row per token ({len(hidden)} for {len(held)})")
        layer = None if hidden is None else hidden_layer
        too_long = len(held) > self.max_tokens  # kept, it would evict every other entry and then itself
        if self.max_tokens == 0 or too_long or len(held) < self.min_match or self._covered(held, layer):
            self.streams.release(sid)
            return
        for other, other_tokens in list(self._entries.items()):  # entries this one covers: its prefixes, unless
            other_layer = self._hidden.get(other, (None,))[0]  # they carry hidden states this one does not
            prefix = len(other_tokens) <= len(held) and np.array_equal(held[: len(other_tokens)], other_tokens)
            if prefix and other_layer in (None, layer):
                self._drop(other)
        self._entries[sid] = held
        if hidden is not None:
            self._hidden[sid] = (hidden_layer, hidden)
        self.held_tokens += len(held)
        if self.held_tokens > self.max_tokens:  # least recently used first, down to 3/4 (the new entry stays)
            for other in [other for other in self._entries if other != sid]:
                if self.held_tokens <= self.max_tokens * 3 // 4:
                    break
                self._drop(other)

    def clear(self) -> None:
        for sid in list(self._entries):
            self._drop(sid)

    def _covered(self, held: np.ndarray, hidden_layer: int | None) -> bool:
        """An entry extends ``held`` already (and carries the same hidden states, if ``held`` has some)."""
        return any(
            len(other) >= len(held)
            and np.array_equal(other[: len(held)], held)
            and (hidden_layer is None or self._hidden.get(sid, (None,))[0] == hidden_layer)
            for sid, other in self._entries.items()
        )

    def _drop(self, sid: int) -> None:
        self.held_tokens -= len(self._entries.pop(sid))
        self._hidden.pop(sid, None)
        self.streams.release(sid)
