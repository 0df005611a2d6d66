"""A perfect BFS speculator: SPEX's explorer told the plain search's tree, to measure SPEX's ceiling in the engine.

``explore/bound.py`` replays plain trees on the engine's throughput curve; it leaves out prompt prefill, the
scheduler and the explorer itself. ``OracleExplorer`` runs the real search on the real backend, but speculates
exactly the children the plain search expanded (its ``Child.key``s, known from a plain run of the same question:
the same seed gives the same thoughts and rewards), each once its parent has finished, up to ``lookahead``
layers ahead and within the shared budget. Its hit rate is 1 and it wastes nothing, so its time is the most
any BFS speculator gains on that engine at that k_total. Worked example: plain expanded (), 0 and (), 1, then
("a",), 0 and ("a",), 1 under the first child "a"; when "a" finishes while its sibling still runs, the oracle
starts ("a",), 0 and ("a",), 1 at once, where SPEX would guess their number from "a"'s reward.
Used by ``scripts/spex_oracle.py``; not a search mode (it needs the answer before it starts).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from spectot.explore.explorer import Explorer, SharedBudget, WidthRule
from spectot.search.expansion import Child, ChildKey, Expander, Node


class OracleExplorer(Explorer):
    def __init__(
        self, expander: Expander, budget: SharedBudget, tree: Iterable[ChildKey], query: int = 0, lookahead: int = 1
    ) -> None:
        super().__init__(expander, budget, query, lookahead)
        self.children: dict[Node, list[ChildKey]] = defaultdict(list)  # plain's children of each node, in rank order
        for key in sorted(tree, key=lambda k: k.index):
            self.children[key.at].append(key)

    def _speculate_children(
        self, siblings: Sequence[Child], pending: int, rule: WidthRule, budget: int, depth_left: int
    ) -> None:
        """Plain's children of every finished sibling (the width rule is not guessed: it is known)."""
        if depth_left <= 0 or not siblings:
            return
        keys = [k for c in siblings for k in self.children.get(c.node, ()) if k not in self._jobs]
        for key in self._granted(keys, siblings, pending, rule, budget, depth_left):
            task = self._launch(key)
            task.add_done_callback(lambda t, d=depth_left: self._after_speculative(t, rule, budget, d))
