"""Logits processing and sampling, shared by the target, the drafts and the AR baseline.

Speculative decoding is lossless only if the target distribution p it verifies against is the
distribution the AR baseline samples from, so every path turns logits into probabilities here.
Greedy decoding (``do_sample=False`` or temperature 0) is represented by one-hot distributions on
the argmax, which makes greedy verification a special case of the sampling rules.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spectot.engine.kernels import decoder_ops, noise_ops


MIN_TEMPERATURE = 1e-5  # vLLM's too: below it sampling is greedy in all but name (whatever the float range)


@dataclass(frozen=True)
class SamplingParams:
    """transformers-style sampling controls; validated eagerly."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # one token takes all the mass there: greedy, said plainly
            raise ValueError(
                f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where sampling is greedy decoding in all "
                "but name; use 0 for greedy decoding"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def nearest(self, temperatures: Iterable[float]) -> float:
        """The measured temperature closest to this sampling's (greedy counts as 0): which of a draft's
        acceptance measurements describes these streams."""
        own = 0.0 if self.greedy else self.temperature
        return min(temperatures, key=lambda t: abs(t - own))

    @classmethod
    def from_temperature(cls, temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
        """CLI convention: temperature 0 means greedy."""
        return cls(do_sample=temperature > 0, temperature=temperature or 1.0, top_k=top_k, top_p=top_p)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Indices of the largest entries along the last dim, the lowest index among ties (torch.argmax's
    rule, for rows of finite values; a row holding a NaN gets an unspecified index: numpy and torch stop at the NaN,
    the kernel's vector max loses it). On the CPU spectot's kernel (``decoder_ops.argmax_rows``) or numpy's vectorised argmax: over a
    verified tree's six rows of a 49,152-token vocabulary numpy took 14 us against torch's 83 us (2-core Zen 5)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        ops = decoder_ops() if x.dtype == torch.float32 and x.dim() == 2 else None
        if ops is not None:
            return ops.argmax_rows(x.contiguous())
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1)))
    return x.argmax(-1)


def logsumexp_rows(logits: torch.Tensor, rows: Sequence[int]) -> list[float]:
    """log sum_j exp(z_j) of the listed rows of (R, V) ``logits``: on a CPU one native pass per row
    (``decoder_ops.logsumexp_rows``, the sum in double); elsewhere, or without the kernel, torch's. A row's
    value depends only on that row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        ops = decoder_ops()
        if ops is not None:
            return ops.logsumexp_rows(logits.contiguous(), torch.tensor(rows, dtype=torch.int64)).tolist()
    return logits[list(rows)].float().logsumexp(-1).tolist()


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.
    Greedy -> one-hot on the argmax (the lowest index among ties, as torch.argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(outside_nucleus(logits.softmax(-1), params.top_p), float("-inf"))
    return logits.softmax(-1)


def outside_nucleus(probs: torch.Tensor, top_p: float, first: int = 256) -> torch.Tensor:
    """(..., V) bool: the tokens top-p drops, those whose strictly more likely tokens already hold ``top_p`` of
    the mass (the first always stays; tokens tied at the edge stay or go together). Each row is read off its
    ``first`` most likely tokens when its nucleus ends among them (0.1 ms for 256 of 49,152 on two Zen 5 cores),
    else from a histogram of log-probabilities (``_row_outside_nucleus``, 0.3 ms); a full sort costs 3.5 ms,
    more than a one-row target forward. Both the rule (no tie order) and the path are the row's own, so a row's
    nucleus is the same alone as beside any rows: a verification batch masks p as plain sampling does. (The
    path was once chosen per batch and ties cut by index, and bf16 logits tie often: a batched row's nucleus
    differed from its own in 170 of 300 rows of a test, TV ~0.003 each.) ``probs``: host float32 / float64."""
    flat = probs.reshape(-1, probs.shape[-1])
    top, order = flat.topk(min(first, flat.shape[-1]), dim=-1)  # (R, first), most likely first
    ahead = (top.cumsum(-1) - top).gather(-1, _tie_starts(top))  # mass of the strictly more likely tokens
    drop_top = (ahead >= top_p) & (ahead > 0)  # the first tokens always stay: a top_p of 1e-300 is 0 in float32
    drop = torch.ones_like(flat, dtype=torch.bool).scatter_(-1, order, drop_top)
    if top.shape[-1] < flat.shape[-1]:  # a row whose nucleus may run past its first tokens: the histogram
        for r in torch.nonzero(~drop_top[:, -1]).flatten().tolist():
            row = flat[r].numpy().astype(np.float64)  # numpy: no thread pool for a row
            drop[r] = torch.from_numpy(_row_outside_nucleus(row, top_p))
    return drop.reshape(probs.shape)


def _tie_starts(top: torch.Tensor) -> torch.Tensor:
    """(R, n) int64: for each entry of rows sorted in descending order, the index of the first entry equal to it.
    Example: [0.4, 0.2, 0.2, 0.1] -> [0, 1, 1, 3]."""
    return torch.searchsorted(-top.contiguous(), -top.contiguous(), side="left")


def _row_outside_nucleus(p: np.ndarray, top_p: float, buckets: int = 1024, span: float = 32.0) -> np.ndarray:
    """One row of ``outside_nucleus`` without sorting it: tokens fall in ``buckets`` bins by log-probability
    below the best (``span`` nats, the rest in the last bin). Bins above the one where the cumulative mass
    first reaches top_p are kept whole, bins below dropped whole; only that bin's tokens are sorted.

    Example: bin masses [0.5, 0.3, 0.15, 0.05], top_p 0.9: bins 0-1 kept (0.8 before bin 2), bin 3 dropped,
    bin 2's tokens kept while 0.8 + the mass before them in the bin is below 0.9."""
    logp = np.log(np.maximum(p, np.finfo(np.float64).tiny))
    bins = np.minimum((logp.max() - logp) * (buckets / span), buckets - 1).astype(np.int64)
    cumulative = np.cumsum(np.bincount(bins, weights=p, minlength=buckets))
    edge = min(int(np.searchsorted(cumulative, top_p)), buckets - 1)  # the first bin reaching top_p
    drop = bins > edge
    members = np.flatnonzero(bins == edge)
    members = members[np.argsort(-p[members], kind="stable")]
    inside = p[members]
    ahead = np.cumsum(inside) - inside  # within the bin, before each member in order
    ahead = ahead[np.searchsorted(-inside, -inside, side="left")]  # ties: the mass strictly above them
    drop[members] = (cumulative[edge - 1] if edge else 0.0) + ahead >= top_p
    return drop


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of (..., V) probabilities -> (...) int64. Host-side, no device sync games:
    exponential race (argmax p / E, E ~ Exp(1)) draws exactly from p."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax(probs / noise)


def noise_key(seed: int, position: int) -> int:
    """The key of the stream's noise at its ``position``-th generated token: a hash of both (distinct (seed, j) draw
    independently), as a signed 64-bit int for the kernel."""
    digest = hashlib.blake2b(f"{seed % 2**64}:{position}".encode(), digest_size=8).digest()  # a negative seed wraps
    return int.from_bytes(digest, "little", signed=True)


def noise_at(seed: int, position: int, ids: torch.Tensor) -> torch.Tensor:
    """E_{j,i} ~ Exp(1) at the token ids ``ids`` (float64), a function of (seed, j, i) only: -log u_i, u_i from a
    counter-based hash of (key(seed, j), i) (``kernels/noise.cpp``; numpy's uint64 arithmetic where it is not
    built). Any subset costs only its own values: a draft reads its head's tokens."""
    module = noise_ops()
    if module is not None:
        return module.exponential(noise_key(seed, position), ids.to(torch.int64))
    return torch.from_numpy(_exponential(noise_key(seed, position), ids.to(torch.int64).numpy()))


def position_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """E_j = (E_{j,1}, ..., E_{j,V}) iid Exp(1), float64: the randomness of a stream's j-th generated token
    (``noise_at`` of tokens 0 .. size - 1, so a smaller vocabulary reads a prefix of a larger one's)."""
    return noise_at(seed, position, torch.arange(size))


_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment; the kernel's constants, for the numpy path


def _exponential(key: int, ids: np.ndarray) -> np.ndarray:
    """``kernels/noise.cpp``'s E_i in numpy (the same bits of u; the log is numpy's)."""
    z = np.uint64(key % 2**64) + np.uint64(_GAMMA) * (ids.astype(np.uint64) + np.uint64(1))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # the top value rounds to 1: the double below
    return -np.log(np.minimum(u, np.nextafter(1.0, 0.0)))


def coupled_pick(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax_i probs_i / E_i over the last dim, (..., V) -> (...): the exponential race, an exact draw from probs
    normalised (a token of probability 0 never wins). The target's sample and a draft's guess made with the same
    E coincide with probability >= (1 - TV) / (1 + TV) of their distributions, and always when they are equal
    (Daliri et al., 2024, "Coupling without communication and drafter-invariant speculative decoding"); the
    draft's argmax alone survives with p(argmax q), which a flat p keeps low."""
    return argmax(probs.double() / noise)


def sample_at(probs: torch.Tensor, seed: int, position: int, noise: torch.Tensor | None = None) -> int:
    """x_j = argmax_i p_{j,i} / E_{j,i}: an exact draw from p_j on the position's own noise (``noise_at``) that
    every engine reproduces, however many tokens its forwards cover; a draft that picked its token with the same
    noise (``coupled_pick``) matches it as often as its distribution allows. ``noise``: E_j if the caller holds it
    already; else the kernel's race finds the argmax without drawing all of E_j (the same token: it takes the exact
    E_{j,i} wherever p_i / (1 - u_i), an upper bound of p_i / E_{j,i}, can win)."""
    on_host = probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64) and probs.dim() == 1
    module = noise_ops() if noise is None and on_host else None
    if module is not None:
        return int(module.race(probs, noise_key(seed, position)))
    if noise is None:
        noise = position_noise(seed, position, probs.shape[-1])
    return int(coupled_pick(probs, noise))


@dataclass(frozen=True)
class CoupledNoise:
    """One stream's noise: ``at(j, ids)`` gives a draft's guess for token j the values E_j the target's draw
    (``sample_at``, which races without them) reads there."""

    seed: int

    def at(self, position: int, ids: torch.Tensor) -> torch.Tensor:
        """E_j at the token ids ``ids`` only (a draft's head): each costs only its own values."""
        return noise_at(self.seed, position, ids)
