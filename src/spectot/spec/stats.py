"""Decoding statistics, with every metric defined once.

- ``mean_acceptance_length``: tokens emitted per target verification step of a stream, **including**
  the recovered/bonus token (plain AR: 1.0). A step whose proposer found nothing counts as 1. A stop (EOS,
  stop string) inside an accepted draft cuts the step there: draft tokens verified past it are not counted
  as accepted, so a stream's new tokens = 1 (the prefill's) + accepted + verification steps.
- ``acceptance_rate``: accepted draft tokens / proposed draft tokens.
- ``acceptance_by_position[i]``: P(draft token i+1 accepted | it was proposed and tokens 1..i were).
- ``accepted_rank[r]``: verification visits of a tree node with children where the child of draft
  rank r (0 = the draft's first) was accepted; ``rank_visits[r]`` counts the visits of nodes that have a child
  of rank r, so accepted_rank[r] / rank_visits[r] estimates Sequoia's positional acceptance vector p_{r+1}
  (a node of fewer children says nothing of rank r: counted, it pulled p_2.. down, 0.13 for a true 0.3).
- calibration (EDD paper, fig. 3b): drafted tokens whose parent was accepted, binned by the draft's
  probability of the token; ``calibration_error`` is the expected calibration error (ECE) over
  ``CALIBRATION_BINS`` equal-width bins.
- Wall time is split into ``draft`` (proposer), ``verify`` (target forwards + verification) and
  ``other`` (prefill, bookkeeping). In a batched call, forwards and times belong to the batch; a stream that
  joins a running session (the continuous engine) gets those of the session while it was in it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


CALIBRATION_BINS = 10


@dataclass
class DecodeStats:
    new_tokens: int = 0
    prompt_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    verify_steps: int = 0  # per-stream verification steps (a batched forward counts once per stream)
    proposed: int = 0
    accepted: int = 0
    reached_by_position: list[int] = field(default_factory=list)  # draft position i was proposed and 1..i accepted
    accepted_by_position: list[int] = field(default_factory=list)
    accepted_rank: list[int] = field(default_factory=list)
    rank_visits: list[int] = field(default_factory=list)  # [r]: visited nodes with a child of rank r
    calibration_n: list[int] = field(default_factory=lambda: [0] * CALIBRATION_BINS)
    calibration_accepted: list[int] = field(default_factory=lambda: [0] * CALIBRATION_BINS)
    calibration_confidence: list[float] = field(default_factory=lambda: [0.0] * CALIBRATION_BINS)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0

    def record_step(self, proposed: int, accepted: int, depth: int | None = None) -> None:
        """One verification: ``proposed`` draft tokens (tree nodes), ``accepted`` of them on the path,
        ``depth`` the draft's depth (a chain's is its length). Position i = depth i."""
        self.verify_steps += 1
        self.proposed += proposed
        self.accepted += accepted
        depth = proposed if depth is None else depth
        reached = min(depth, accepted + 1)  # depths after the first rejection were never tested
        _tally(self.reached_by_position, self.accepted_by_position, reached, range(min(accepted, reached)))

    def record_ranks(self, outcomes: list[tuple[int, int]]) -> None:
        """One verification's outcome at each visited node with children: (the accepted child's rank among its
        siblings, or -1 where every child was rejected; how many children it had)."""
        for rank, width in outcomes:
            _tally(self.rank_visits, self.accepted_rank, width, (rank,) if rank >= 0 else ())

    def record_calibration(self, confidence: list[float], accepted: list[bool]) -> None:
        """Drafted tokens that were tested (their parent was accepted): draft probability, outcome."""
        for conf, ok in zip(confidence, accepted):
            b = min(int(conf * CALIBRATION_BINS), CALIBRATION_BINS - 1)
            self.calibration_n[b] += 1
            self.calibration_accepted[b] += int(ok)
            self.calibration_confidence[b] += conf

    @property
    def calibration_error(self) -> float:
        total = sum(self.calibration_n)
        return (
            sum(abs(a - c) for a, c in zip(self.calibration_accepted, self.calibration_confidence)) / total
            if total
            else 0.0
        )

    def acceptance_vector(self) -> list[float]:
        return [a / v for a, v in zip(self.accepted_rank, self.rank_visits)]

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def time_other(self) -> float:
        return max(self.time_total - self.time_draft - self.time_verify, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_by_position=[
                a / r if r else 0.0 for a, r in zip(self.accepted_by_position, self.reached_by_position)
            ],
            time_other=self.time_other,
            calibration_error=self.calibration_error,
            tokens_per_second=self.tokens_per_second,
        )
        return out


def _tally(tried: list[int], accepted: list[int], n: int, hits: Iterable[int]) -> None:
    """Positions 0..n-1 tried once more (the lists grown to reach them), those in ``hits`` accepted."""
    grow = n - len(tried)
    if grow > 0:
        tried += [0] * grow
        accepted += [0] * grow
    for i in range(n):
        tried[i] += 1
    for i in hits:
        accepted[i] += 1
