"""SPEX's adaptive early termination: stop exploring a query once its weighted vote has a clear winner.

With the finished answers grouped and weighted as in REBASE's vote (``spectot.search.rebase.weighted_vote``:
conf of a group = the sum of its members' weights), the search stops when

    n >= t   and   conf_1st - conf_2nd > alpha * avg(w_2nd)

n: answers collected so far, t: the minimum number of answers, conf_1st / conf_2nd: the two heaviest groups'
weights, avg(w_2nd): the mean weight of the second group's members, alpha = 0.5. With a single group the search
is settled as soon as n >= t; with none it is not. Worked example: groups (weight, count) [(2.4, 3), (0.9, 2)],
n = 5, t = 4: 2.4 - 0.9 = 1.5 > 0.5 * 0.45 -> settled.
"""

from __future__ import annotations

from collections.abc import Sequence

from spectot.search.rebase import AnswerGroup


def settled(groups: Sequence[AnswerGroup], n_answers: int, t: int, alpha: float = 0.5) -> bool:
    """Whether n >= t and conf_1st - conf_2nd > alpha * avg(w_2nd) (a lone group: n >= t suffices)."""
    if n_answers < t or not groups:
        return False
    ranked = sorted(groups, key=lambda group: -group.weight)  # heaviest first (ties: given order)
    if len(ranked) == 1:
        return True
    first, second = ranked[0], ranked[1]
    return first.weight - second.weight > alpha * second.mean_weight  # conf_1st - conf_2nd > alpha avg(w_2nd)
