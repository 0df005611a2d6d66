"""REBASE, reward balanced search (Wu et al. 2024, "Inference Scaling Laws", Sec. 3.2): the width rule and the
weighted majority vote that picks the final answer.

Width rule. At each depth the open leaves n_1..n_K with process rewards R(n_j) share a budget of B children:

    W_j = round(B * exp(R(n_j) / T_b) / sum_k exp(R(n_k) / T_b))        # T_b: balance temperature (0.2)

``round`` is largest-remainder rounding, so the widths are >= 0 and sum to exactly B: every node first gets
floor(B p_j), then the B - sum floor(B p_j) leftover children go one each to the largest remainders (ties to the
earlier node). Worked example, B = 4, rewards [0.5, 0.5, 0.5] (p = 1/3 each): quotas [1.33, 1.33, 1.33],
floors [1, 1, 1], one child left over, remainders tie -> widths [2, 1, 1]. (The REBASE / ETS authors' code
rounds differently: in descending reward order each node takes ceil(B_left p_j / sum of the p left), which gives
[2, 2, 0] here and [3, 1, 0] for rewards [0.9, 0.7, 0.6]; largest remainder is the rounding of B p_j that sums
to B and stays closest to it.)

Weighted vote. The finished solutions' answers are grouped by an equivalence (``same``, e.g. MATH-500's
``is_equiv``); a group's confidence is the sum of its members' weights (rewards); the group with the largest
confidence wins. SPEX's early-termination test (``spectot.explore.termination``) reads the same groups.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AnswerGroup:
    answer: str  # the representative: the first answer seen in the group
    weight: float  # conf: the sum of the members' weights
    count: int  # members (answers) in the group

    @property
    def mean_weight(self) -> float:
        """avg(w): the mean weight of the group's members."""
        return self.weight / self.count


def balance_probabilities(rewards: Sequence[float], temperature: float) -> np.ndarray:
    """softmax(R / T_b) over the nodes, in float64 (shifted by the max, so large rewards do not overflow)."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature T_b must be a number > 0, got {temperature}")
    r = np.asarray(rewards, dtype=np.float64)  # (K,)
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite numbers, got {list(rewards)}")
    logits = (r - r.max()) / temperature
    weights = np.exp(logits)
    return weights / weights.sum()


def largest_remainder(quotas: np.ndarray, total: int) -> list[int]:
    """Integers >= 0 summing to ``total``, each floor(quota) plus one for the largest remainders (ties: earlier)."""
    floors = np.floor(quotas).astype(np.int64)  # (K,)
    leftover = total - int(floors.sum())
    order = sorted(range(len(quotas)), key=lambda j: -(quotas[j] - floors[j]))  # stable: ties keep index order
    for j in order[: max(leftover, 0)]:
        floors[j] += 1
    return [int(w) for w in floors]


def rebase_widths(rewards: Sequence[float], budget: int, temperature: float = 0.2) -> list[int]:
    """Children per node: W_j = round(B * softmax(R(n_j) / T_b)_j), widths >= 0 summing to exactly B."""
    if operator.index(budget) < 0:  # a count: 2.7 is refused here, not as a slice error below
        raise ValueError(f"budget B must be >= 0, got {budget}")
    if len(rewards) == 0:
        return []
    p = balance_probabilities(rewards, temperature)  # (K,) softmax(R / T_b)
    return largest_remainder(budget * p, budget)  # W_j = round(B p_j), sum_j W_j = B


def weighted_vote(
    answers: Sequence[str | None],
    weights: Sequence[float],
    same: Callable[[str, str], bool] = operator.eq,
) -> list[AnswerGroup]:
    """Answers grouped by ``same(representative, answer)``, heaviest group first (ties: first seen); None skipped."""
    if len(answers) != len(weights):
        raise ValueError(f"one weight per answer: got {len(answers)} answers and {len(weights)} weights")
    groups: list[AnswerGroup] = []
    for answer, weight in zip(answers, weights):
        if answer is None:
            continue
        for g, group in enumerate(groups):
            if same(group.answer, answer):
                groups[g] = AnswerGroup(group.answer, group.weight + float(weight), group.count + 1)
                break
        else:
            groups.append(AnswerGroup(answer, float(weight), 1))
    return sorted(groups, key=lambda group: -_tied(group.weight))  # conf = sum of member weights; stable sort


def _tied(weight: float) -> float:
    """A group's weight as votes compare it: sums of equal rewards taken in another order differ in their last bits
    (0.1 + 0.2 > 0.3, 1/9 + 5/9 > 6/9), which decided a tie by rounding instead of first seen."""
    return round(weight, 9)


def best_answer(groups: Sequence[AnswerGroup]) -> str | None:
    """The representative of the heaviest group (the first seen among tied ones), or None when nothing was
    answered."""
    return max(groups, key=lambda group: _tied(group.weight)).answer if groups else None
