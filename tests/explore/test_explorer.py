"""SPEX's explorer on a scripted backend with random latencies.

- speculation off is the plain algorithm: the same expansions, leaves and answer as ``PlainSource``;
- REBASE / ETS decisions depend only on the children's results, so speculation on gives the very same
  tree — only faster;
- no expansion is lost or run twice for the search, primary requests always go at priority 0,
  speculative work never exceeds the budget, and cancellation releases every unit of budget;
- MCTS with exact speculation (the default) is the plain search, tree for tree; with the paper's folding
  it folds exactly ``budget`` rollouts and counts its hits.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import replace
from collections import Counter

import pytest

from spectot.backends.base import Completion, CompletionRequest
from spectot.explore.explorer import Explorer, SharedBudget, expected_widths
from spectot.explore.oracle import OracleExplorer
from spectot.explore.queries import ExploreConfig, run_queries
from spectot.explore.termination import settled
from spectot.search.bfs import reward_balanced_search, width_rule
from spectot.search.expansion import NEXT, PRIMARY, SPECULATIVE, Child, ChildKey, ExpansionSampling, Expander
from spectot.search.mcts import _claim, _fold, _predicted, _Tree, mcts_search
from spectot.search.tree_search import PlainSource, TreeSearchConfig, root_child
from spectot.search.uct import MctsTree
from spectot.tasks.base import Problem, StepRequest, Task


class ToyTask(Task):
    """Steps are words; a state is final at depth 3 or when a step says "answer N"."""

    name, depth, value_range = "toy", 3, (0.0, 9.0)

    def thought(self, problem, state):
        return StepRequest("think|" + "|".join(state), (), 8)

    def parse_thought(self, problem, state, text):
        return text

    def value(self, problem, state):
        return StepRequest("value|" + "|".join(state), (), 2)

    def parse_value(self, text):
        return float(text)

    def is_final(self, problem, state):
        return len(state) >= self.depth or state[-1].startswith("answer")

    def final_answer(self, problem, state):
        return state[-1].split()[-1] if state[-1].startswith("answer") else ""

    def grade(self, problem, answer):
        return float(answer == problem.answer)


def _digest(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little")


class ScriptedBackend:
    """Text is a pure function of (prompt, seed); latency is random (seeded by the test)."""

    name = "scripted"

    def __init__(self, seed: int = 0, max_latency: float = 0.01) -> None:
        self.rng, self.max_latency = random.Random(seed), max_latency
        self.log: list[CompletionRequest] = []
        self.cancelled = 0
        self.cancelled_ids: set[int] = set()  # id() of the logged requests that were cancelled

    async def complete(self, request: CompletionRequest) -> Completion:
        self.log.append(request)
        try:
            await asyncio.sleep(self.latency(request))
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancelled_ids.add(id(request))
            raise
        h = _digest(request.prompt, request.seed)
        if request.prompt.startswith("value"):
            text = str(h % 10)
        else:
            text = f"answer {h % 3}" if h % 4 == 0 else f"w{h % 97}"
        return Completion(text, "stop", 4, 2)

    def latency(self, request: CompletionRequest) -> float:
        return self.rng.random() * self.max_latency

    async def aclose(self) -> None:
        pass


PROBLEM = Problem("p0", "toy", "1")


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when every task waits on a timer: a sleep takes no real time and the
    scripted latencies order events the same way on any machine, however loaded (on a busy CI runner real sleeps
    reordered them and the wasted-token totals drifted)."""

    def __init__(self) -> None:
        super().__init__()
        self.now, real = 0.0, self._selector
        loop = self

        class Selector:
            def select(self, timeout=None):
                events = real.select(0)
                if events or timeout is None or timeout <= 0:
                    return events or real.select(timeout)
                loop.now += timeout
                return []

            def __getattr__(self, name):
                return getattr(real, name)

        self._selector = Selector()

    def time(self) -> float:
        return self.now


def run_virtual(coroutine):
    """``asyncio.run`` on a ``VirtualClockLoop``."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(coroutine)


def run(search, source_of, config, stop=None, seed=0, run_seed=7):
    """``seed``: the backend's latencies; ``run_seed``: the expansions' sampling seeds (the toy tree)."""
    backend = ScriptedBackend(seed)

    async def main():
        expander = Expander(ToyTask(), PROBLEM, backend, "self_eval", seed=run_seed)
        source = source_of(expander)
        try:
            return await search(ToyTask(), PROBLEM, source, config, stop), source, backend
        finally:
            await source.close()

    return run_virtual(main())


def shape(result):
    return [c.key for c in result.expansions], [c.state for c in result.leaves], result.answer


@pytest.mark.parametrize("algorithm", ["rebase", "ets"])
@pytest.mark.parametrize("latency_seed", [0, 1, 2])
@pytest.mark.parametrize("retract", [True, False])
def test_bfs_tree_is_the_same_with_and_without_speculation(algorithm, latency_seed, retract) -> None:
    config = TreeSearchConfig(algorithm, budget=6)
    plain, _, _ = run(reward_balanced_search, PlainSource, config, seed=latency_seed)
    off, _, _ = run(reward_balanced_search, lambda e: Explorer(e, None), config, seed=latency_seed)
    budget = SharedBudget(k_total=4)
    on, explorer, backend = run(
        reward_balanced_search, lambda e: Explorer(e, budget, lookahead=2, retract=retract), config, seed=latency_seed
    )
    assert shape(plain) == shape(off) == shape(on)
    # every thought the search consumed was generated once (again only after a retracted run was cancelled);
    # speculative requests never exceeded the budget
    thoughts = Counter((r.prompt, r.seed) for r in backend.log if r.prompt.startswith("think"))
    assert sum(n - 1 for n in thoughts.values()) <= (backend.cancelled if retract else 0)
    # (a needed thought retracted while it ran speculatively has that cancelled request in the log too)
    needed = [r for r in backend.log if (r.prompt, r.seed) in _primary(plain, backend)]
    assert all(r.priority == 0 for r in needed if id(r) not in backend.cancelled_ids)
    assert explorer.counters.speculated > 0 and explorer.counters.budget_peak <= 4
    assert explorer.counters.speculative_seconds > 0  # budget use: the speculative expansions' run time
    assert budget.in_flight.get(0, 0) == 0  # cancelled and finished speculation gave its budget back
    assert budget.primary == 0  # every primary expansion was counted out


def test_a_levels_finished_children_are_predicted_in_the_searchs_order(monkeypatch) -> None:
    """They were passed in finishing order: REBASE gives the earlier of tied siblings the extra child, so with
    tied rewards even the last prediction of a level (every sibling finished) named the wrong child."""
    seen: list[list[int]] = []
    real = Explorer._speculate_children

    def recording(self, finished, *args, **kwargs):
        seen.append([c.key.index for c in finished if c.key.parent == ()])
        return real(self, finished, *args, **kwargs)

    monkeypatch.setattr(Explorer, "_speculate_children", recording)
    config = TreeSearchConfig("rebase", budget=6)
    for seed in range(4):
        run(reward_balanced_search, lambda e: Explorer(e, SharedBudget(k_total=4), lookahead=1), config, seed=seed)
    first_level = [indices for indices in seen if indices]
    assert first_level and all(indices == sorted(indices) for indices in first_level)
    assert any(len(indices) > 1 for indices in first_level)


def test_a_promoted_fold_rollout_is_not_counted_twice_against_the_budget(monkeypatch) -> None:
    """A speculative fold rollout chosen as the next simulation kept its held units while its later steps also
    counted as primary work: the budget counted more expansions than ran (seeds 5 and 11 here), and speculation
    elsewhere got less. Measured as the time integral of (units counted - expansions running), over when positive."""
    live, state = [0], {"budget": None, "last": None, "over": 0.0}

    def sample() -> None:
        budget = state["budget"]
        if budget is None:
            return
        now = asyncio.get_event_loop().time()
        counted = budget.primary + sum(budget.in_flight.values()) - live[0]
        if state["last"] is not None:
            then, before = state["last"]
            state["over"] += max(before, 0) * (now - then)
        state["last"] = (now, counted)

    expand = Expander.expand

    async def counted_expand(self, key, priority=PRIMARY):
        live[0] += 1
        sample()
        try:
            return await expand(self, key, priority)
        finally:
            live[0] -= 1
            sample()

    monkeypatch.setattr(Expander, "expand", counted_expand)
    for name in ("started", "finished", "primary_finished"):
        method = getattr(SharedBudget, name)

        def sampled(self, *args, method=method, **kwargs):
            result = method(self, *args, **kwargs)
            sample()
            return result

        monkeypatch.setattr(SharedBudget, name, sampled)
    count_primary = Explorer._count_primary
    monkeypatch.setattr(Explorer, "_count_primary", lambda self, task: (count_primary(self, task), sample())[0])
    config = TreeSearchConfig("rstar", budget=12, max_children=3, dfs_speculation="fold")
    for seed in (5, 11):
        state.update(last=None, over=0.0)

        def source(e):
            state["budget"] = SharedBudget(k_total=3)
            return Explorer(e, state["budget"])

        run(mcts_search, source, config, seed=seed, run_seed=seed)
        assert state["over"] < 1e-9, (seed, state["over"])


def test_speculation_gets_only_what_primary_work_leaves() -> None:
    budget = SharedBudget(k_total=4)
    assert budget.grant(0, wanted=9, kv_reuse=1.0) == 4
    budget.primary = 3
    assert budget.grant(0, wanted=9, kv_reuse=1.0) == 1
    budget.started(0)
    assert budget.grant(0, wanted=9, kv_reuse=1.0) == 0  # 3 primary + 1 speculative fill k_total
    budget.primary = 6  # primary work alone past k_total: it never waits, speculation gets nothing
    budget.finished(0)
    assert budget.grant(0, wanted=9, kv_reuse=1.0) == 0


def test_a_query_s_running_speculation_is_not_counted_twice() -> None:
    """C_q = running + asked-and-not-granted: counting a granted request again once it runs (capacity 8 for a
    query running 4) gave query 0 softmax share 0.98 of 8, and query 1 nothing while 4 units idled."""
    budget = SharedBudget(k_total=8)
    assert budget.grant(0, wanted=4, kv_reuse=1.0) == 4
    budget.started(0, 4)
    assert budget.grant(1, wanted=4, kv_reuse=1.0) == 4
    budget.started(1, 4)
    for _ in range(4):
        budget.finished(0)
    budget.leave(0)
    assert (budget.kv_reuse, budget.in_flight) == ({1: 1.0}, {1: 4})


def test_units_a_query_was_refused_are_not_held_for_it() -> None:
    """Query 0 asks for 10 while primary work fills k_total and gets none, then waits at its barrier (asking
    nothing). Once the units free up, query 1 asking for 3 gets them: the refused 10 were kept as query 0's C_q,
    its softmax share took the units and query 1 got 0 while they idled."""
    budget = SharedBudget(k_total=8)
    budget.primary = 8
    assert budget.grant(0, wanted=10, kv_reuse=1.0) == 0
    budget.primary = 2
    assert budget.grant(1, wanted=3, kv_reuse=0.5) == 3


def test_a_refused_query_is_woken_once_when_units_free_up() -> None:
    budget, calls = SharedBudget(k_total=4, wake_up=True), []
    budget.primary = 4
    assert budget.grant(0, wanted=2, kv_reuse=1.0, wake=lambda: calls.append(0)) == 0
    assert budget.grant(1, wanted=2, kv_reuse=1.0, wake=lambda: calls.append(1)) == 0
    budget.primary_finished()
    assert calls == [0, 1]  # each refused query once, in the order they asked
    budget.primary_finished()
    assert calls == [0, 1]  # nobody asked again
    assert budget.grant(0, wanted=1, kv_reuse=1.0, wake=lambda: calls.append(9)) == 1  # granted: no wake-up kept
    budget.started(0)
    budget.grant(1, wanted=8, kv_reuse=1.0, wake=lambda: calls.append(1))
    budget.leave(1)  # a query that is done is not woken
    budget.finished(0)
    assert calls == [0, 1]


class Straggler(ScriptedBackend):
    """The search's first request takes 20 s, every other one 1 s; logs when each request starts."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[tuple[float, int]] = []  # (time, priority)

    def latency(self, request: CompletionRequest) -> float:
        self.starts.append((asyncio.get_running_loop().time(), int(request.priority)))
        return 20.0 if len(self.log) == 1 else 1.0


@pytest.mark.parametrize(("algorithm", "mode"), [("rebase", "exact"), ("rstar", "exact"), ("rstar", "fold")])
@pytest.mark.parametrize(("wake_up", "first"), [(True, 5.0), (False, 21.0)])
def test_a_refused_query_speculates_as_soon_as_another_querys_work_ends(algorithm, mode, wake_up, first) -> None:
    """Another query's primary work fills k_total until t = 5, so this query's first asks are refused. It starts
    speculating at t = 5, while its straggler still runs (to t = 20); without the wake-up (the default: it gained
    nothing measured) it asks again only when one of its own expansions ends (BFS: at t = 21, its level done;
    DFS: the straggling rollout's first step)."""
    backend, budget = Straggler(), SharedBudget(k_total=4, wake_up=wake_up)
    budget.primary = 4  # the other query's

    async def other_query_ends() -> None:
        await asyncio.sleep(5)
        for _ in range(4):
            budget.primary_finished()

    async def main():
        expander = Expander(ToyTask(), PROBLEM, backend, "self_eval", seed=0)  # its first level: no answers
        source = Explorer(expander, budget, lookahead=2)
        other = asyncio.create_task(other_query_ends())
        try:
            config = TreeSearchConfig(algorithm, budget=4, dfs_speculation=mode)
            search = reward_balanced_search if algorithm == "rebase" else mcts_search
            return await search(ToyTask(), PROBLEM, source, config, None)
        finally:
            await source.close()
            await other

    run_virtual(main())
    first_speculative = min(t for t, priority in backend.starts if priority != PRIMARY)
    assert first_speculative == pytest.approx(first)


def test_a_late_wake_up_starts_nothing_the_search_moved_away_from() -> None:
    """A level child refused speculation keeps its ask; if the search drops that child's subtree (``retain``) before
    units free up, the wake-up must not start its children."""
    budget = SharedBudget(k_total=2, wake_up=True)
    budget.primary = 2

    async def main():
        explorer = Explorer(Expander(ToyTask(), PROBLEM, ScriptedBackend(), "self_eval"), budget)
        child = Child.make_dummy((), 0, reward=0.9)
        explorer._speculate_children([child], 0, width_rule(TreeSearchConfig("rebase", budget=2)), 2, 1)
        assert not explorer._jobs and budget.waiting  # refused, asking again later
        explorer.retain(lambda key: key.at != child.node)  # the search moves on without it
        budget.primary_finished()
        launched = list(explorer._jobs)
        await explorer.close()
        return launched

    assert run_virtual(main()) == []


def test_early_finishers_get_the_width_they_would_get_beside_their_running_siblings() -> None:
    rule = width_rule(TreeSearchConfig("rebase", budget=4))  # T_b = 0.2
    first = [Child.make_dummy((), 0, reward=0.6)]
    assert rule(first, 4) == [4]  # the rule over the finished alone hands the whole level to the first
    assert expected_widths(rule, first, pending=3, budget=4) == [1]  # beside 3 siblings at its reward
    two = [Child.make_dummy((), 0, reward=0.9), Child.make_dummy((), 1, reward=0.5)]
    # stand-ins at the mean 0.7: softmax([4.5, 2.5, 3.5, 3.5]) = [0.53, 0.07, 0.20, 0.20] -> [2, 0, 1, 1]
    assert expected_widths(rule, two, pending=2, budget=4) == [2, 0]
    assert expected_widths(rule, two, pending=0, budget=4) == rule(two, 4) == [4, 0]


def test_a_second_layer_is_speculated_with_its_whole_level_sharing_the_budget() -> None:
    """Lookahead 2: a speculated child's own children get the width it would get among the ``budget`` nodes of its
    level (the rest stood in at the mean reward), not the whole budget as if its family were the level. Over the
    family alone (the bug this guards), the toy's hit rate at lookahead 2 fell to ~0.42 against ~0.82 at 1."""
    speculated = hits = 0
    for seed in range(8):
        for b in (4, 8):
            config, budget = TreeSearchConfig("rebase", budget=b), SharedBudget(k_total=16)
            source = lambda e, budget=budget: Explorer(e, budget, lookahead=2)  # noqa: E731
            _, explorer, _ = run(reward_balanced_search, source, config, seed=seed)
            speculated, hits = speculated + explorer.counters.speculated, hits + explorer.counters.hits
    assert speculated > 50 and hits / speculated > 0.6


def test_retracting_stops_speculation_the_latest_widths_drop() -> None:
    """A speculated child whose parent's predicted width falls below its index (a later sibling scored higher) is
    cancelled while it runs, so fewer speculated children run to the end unused; the hits do not change (toy,
    32 searches on the virtual clock: 4 against 60 wasted tokens, 144 hits either way)."""
    totals = {}
    for retract in (False, True):
        wasted = hits = cancelled = 0
        for seed in range(16):
            for b in (4, 8):
                config, budget = TreeSearchConfig("rebase", budget=b), SharedBudget(k_total=8)
                source = lambda e, budget=budget, r=retract: Explorer(e, budget, lookahead=2, retract=r)  # noqa: E731
                _, explorer, _ = run(reward_balanced_search, source, config, seed=seed)
                wasted += explorer.counters.wasted_tokens
                hits += explorer.counters.hits
                cancelled += explorer.counters.cancelled
                assert budget.in_flight.get(0, 0) == 0
        totals[retract] = wasted, hits, cancelled
    (wasted_off, hits_off, cancelled_off), (wasted_on, hits_on, cancelled_on) = totals[False], totals[True]
    assert cancelled_on > cancelled_off and wasted_on < 0.7 * wasted_off
    assert hits_on > 0.9 * hits_off


def test_no_speculation_runs_below_a_child_nobody_will_ask_for() -> None:
    """Two kinds of dead work held budget: the search's retain kept what ran under frontier children the level
    does not ask for, and a retract cancelled only a dropped child, not what ran below it (a finished child
    beyond its parent's width is kept, and its own speculated children ran on). Checked at every level start
    and after every retract (toy, 48 searches on the virtual clock: 2 and 29 such jobs before)."""
    seen = {"levels": 0, "retracts": 0, "dead": []}

    def running(explorer: Explorer) -> list[ChildKey]:
        return [k for k, j in explorer._jobs.items() if j.speculative and not j.used and not j.task.done()]

    class Watched(Explorer):
        async def level(self, keys, rule=None, budget=0):
            seen["levels"] += 1
            asked = {k.node for k in keys}
            depth = len(keys[0].node)
            seen["dead"] += [k for k in running(self) if len(k.at) >= depth and k.at[:depth] not in asked]
            return await super().level(keys, rule, budget)

        def _retract(self, widths):
            super()._retract(widths)
            seen["retracts"] += 1
            for k in running(self):
                for parent, width in widths.items():
                    below = k.node[: len(parent) + 1]
                    if len(below) > len(parent) and below[: len(parent)] == parent and below[-1] >= width:
                        seen["dead"].append(k)

    for seed in range(8):
        for run_seed in range(6):
            config, budget = TreeSearchConfig("rebase", budget=8), SharedBudget(k_total=6 + seed % 3)
            source = lambda e, budget=budget: Watched(e, budget, lookahead=2)  # noqa: E731
            run(reward_balanced_search, source, config, seed=seed, run_seed=run_seed)
    assert seen["levels"] > 100 and seen["retracts"] > 500
    assert seen["dead"] == []


@pytest.mark.parametrize("lookahead", [1, 2])
def test_the_oracle_speculates_plains_tree_and_nothing_else(lookahead) -> None:
    """Told the plain tree, the explorer speculates only nodes of it (hit rate 1, nothing cancelled or wasted),
    within k_total, and the search is still plain's; SPEX's own guesses on the same toy miss some."""
    for seed in range(4):
        config = TreeSearchConfig("rebase", budget=6)
        plain, _, _ = run(reward_balanced_search, PlainSource, config, seed=seed)
        tree = [c.key for c in plain.expansions]
        budget = SharedBudget(k_total=8)
        source = lambda e, b=budget, t=tree: OracleExplorer(e, b, t, lookahead=lookahead)  # noqa: E731
        on, oracle, _ = run(reward_balanced_search, source, config, seed=seed)
        assert shape(on) == shape(plain)
        c = oracle.counters
        assert c.speculated > 0 and c.hits == c.speculated and c.cancelled == c.wasted_tokens == 0
        assert c.budget_peak <= 8 and budget.in_flight.get(0, 0) == 0
    hits = speculated = 0
    for seed in range(4):
        guess = SharedBudget(k_total=8)
        _, spex, _ = run(reward_balanced_search, lambda e, g=guess: Explorer(e, g, lookahead=2), config, seed=seed)
        hits, speculated = hits + spex.counters.hits, speculated + spex.counters.speculated
    assert hits < speculated


def _primary(plain, backend):
    """(prompt, seed) of the thought requests the plain search needed."""
    wanted = {"think|" + "|".join(c.key.parent) for c in plain.expansions}
    return {(r.prompt, r.seed) for r in backend.log if r.prompt in wanted and r.priority == 0}


@pytest.mark.parametrize("algorithm", ["rstar", "rest-mcts"])
def test_mcts_without_speculation_is_the_plain_algorithm(algorithm) -> None:
    config = TreeSearchConfig(algorithm, budget=6, max_children=3, rest_children=2)
    plain, _, _ = run(mcts_search, PlainSource, config)
    off, _, _ = run(mcts_search, lambda e: Explorer(e, None), config)
    assert shape(plain) == shape(off)
    # a re-selected terminal node backs its reward up again, no new leaf; REST-MCTS's answered siblings are leaves
    assert 1 <= len(plain.leaves) <= 6 * config.rest_children if algorithm == "rest-mcts" else 6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_answer_rest_mcts_expands_votes_once(seed) -> None:
    """A step expands ``rest_children`` children and keeps the best; an answered sibling it did not keep was paid
    for but never voted (and UCT's first visit to it only backed its reward up again)."""
    config = TreeSearchConfig("rest-mcts", budget=8, max_children=3, rest_children=3)
    result, _, _ = run(mcts_search, PlainSource, config, run_seed=seed)
    answered = [c.state for c in result.expansions if c.final]
    assert sorted(c.state for c in result.leaves if c.final) == sorted(answered)


@pytest.mark.parametrize("algorithm", ["rstar", "rest-mcts"])
@pytest.mark.parametrize("latency_seed", [0, 1, 2, 3])
def test_mcts_exact_speculation_is_the_plain_search(algorithm, latency_seed) -> None:
    config = TreeSearchConfig(algorithm, budget=10, max_children=4, rest_children=2)
    plain, _, _ = run(mcts_search, PlainSource, config, seed=latency_seed)
    budget = SharedBudget(k_total=4)
    on, explorer, backend = run(mcts_search, lambda e: Explorer(e, budget), config, seed=latency_seed)
    assert shape(on) == shape(plain)  # the same expansions in the same order, the same leaves and answer
    # the likeliest pre-run's steps go at NEXT, the others' at SPECULATIVE
    assert NEXT in {r.priority for r in backend.log} <= {PRIMARY, NEXT, SPECULATIVE}
    # a pre-run step the search took over goes on as primary work: its requests' live priority was raised to 0
    # (whether any of them was still to be asked then depends on the latencies)
    taken_over = [r for r in backend.log if r.live_priority is not None and r.live_priority.value == PRIMARY]
    assert taken_over
    counters = explorer.counters
    assert 0 < counters.hits <= counters.speculated  # pre-runs were used, none counted twice
    assert counters.expansions_used == len(on.expansions) and 0 < counters.saving_rate < 1
    assert counters.budget_peak <= 4 and budget.in_flight.get(0, 0) == 0 and budget.primary == 0


def test_exact_speculation_predicts_the_next_selections() -> None:
    """The worked example of ``_predicted``: the root's other indices come whatever the rewards, then the
    descents reach the children still being rolled out, with nothing known below them to pre-run."""
    c = TreeSearchConfig("rstar").c

    def predicted(tree, chains, pending, n=5):
        return [(start.state, index) for start, index in _predicted(tree, chains, pending, n, c)]

    def new_tree():
        return _Tree(MctsTree(children={}), {0: root_child()}, {}, 3, 1, 3)

    tree = new_tree()
    assert predicted(tree, {}, _claim(tree, (0,))) == [((), 1), ((), 2)]
    # the same, but the running rollout's first step is known (a, reward 0.9): after the root's indices, the
    # root's children (a and the two rollouts of indices 1 and 2) each have one visit at the stand-in 0.5,
    # the tie goes to the first, a, whose index 1 comes next; a now has two visits, so the two unknown
    # children take a descent each (nothing to pre-run), and then a's index 2 is the hedge
    tree = new_tree()
    a = replace(Child.make_dummy((), 0, reward=0.9), final=False)
    pending = _claim(tree, (0,))
    pending.chain.append([a])
    expected = [((), 1), ((), 2), (a.state, 1), (a.state, 2)]
    assert predicted(tree, {ChildKey((), 0): pending.chain}, pending) == expected
    # a's rollout folded (reward 0.9: the stand-in is now 0.9), the next pending at the root's index 1: the
    # root's index 2, then a's indices 1 and 2 as above; a is then full and nothing known is left
    tree = new_tree()
    first = _claim(tree, (0,))
    first.chain = [[a]]
    _fold(tree, first)
    assert predicted(tree, {}, _claim(tree, (0,))) == [((), 2), (a.state, 1), (a.state, 2)]


@pytest.mark.parametrize("algorithm", ["rstar", "rest-mcts"])
def test_mcts_speculation_folds_every_rollout_and_releases_budget(algorithm) -> None:
    config = TreeSearchConfig(algorithm, budget=8, max_children=4, rest_children=2, dfs_speculation="fold")
    budget = SharedBudget(k_total=3)
    result, explorer, backend = run(mcts_search, lambda e: Explorer(e, budget), config)
    assert 1 <= len(result.leaves) <= 8
    assert explorer.counters.speculated > 0
    # the search ran to its budget, so every speculative rollout was promoted or folded in: all hits
    assert explorer.counters.hits == explorer.counters.speculated and explorer.counters.cancelled == 0
    # every expansion the search consumed is counted once, primary or speculative, so the saving rate is a share
    counters = explorer.counters
    assert counters.expansions_used == len(result.expansions)
    assert 0 < counters.saved_expansions < counters.expansions_used and 0 < counters.saving_rate < 1
    assert explorer.counters.budget_peak <= 3 and explorer.counters.speculative_seconds > 0
    assert budget.in_flight.get(0, 0) == 0
    assert result.answer in {"0", "1", "2", ""}


def search_on(backend, search, config, budget: SharedBudget):
    """``search`` with an explorer over ``backend``: (result, explorer)."""

    async def main():
        explorer = Explorer(Expander(ToyTask(), PROBLEM, backend, "self_eval", seed=7), budget)
        try:
            return await search(ToyTask(), PROBLEM, explorer, config), explorer
        finally:
            await explorer.close()

    return run_virtual(main())


class FlakyBackend(ScriptedBackend):
    """Fails the first ``failures`` requests sent at a speculative priority (a timeout, an aborted request)."""

    def __init__(self, seed: int = 0, failures: int = 1) -> None:
        super().__init__(seed)
        self.failures = failures

    async def complete(self, request: CompletionRequest) -> Completion:
        if request.priority != PRIMARY and self.failures:
            self.failures -= 1
            await asyncio.sleep(0.001)
            raise RuntimeError("a speculative request failed")
        return await super().complete(request)


@pytest.mark.parametrize(
    ("algorithm", "mode"), [("rebase", "exact"), ("rstar", "exact"), ("rest-mcts", "exact"), ("rstar", "fold")]
)
def test_a_failed_speculative_expansion_is_a_miss_not_the_searchs_failure(algorithm, mode) -> None:
    config = TreeSearchConfig(algorithm, budget=10, max_children=4, rest_children=2, dfs_speculation=mode)
    search = reward_balanced_search if algorithm == "rebase" else mcts_search
    plain, _, _ = run(search, PlainSource, config)
    for failures in (1, 3):
        backend = FlakyBackend(failures=failures)
        result, explorer = search_on(backend, search, config, SharedBudget(k_total=4))
        assert backend.failures < failures  # failures happened
        if mode == "exact":  # and the search is still the plain one
            assert shape(result) == shape(plain)
        assert len(result.leaves) >= 1
        assert explorer.counters.failed + explorer.counters.cancelled >= 1


def test_fold_holds_a_unit_for_each_expansion_a_rollout_runs_at_once() -> None:
    """A REST-MCTS rollout runs rest_children expansions a step: it holds that many units (it held one, so
    k_total 4 let 4 rollouts of 3 expansions run speculatively at once)."""

    class Counting(ScriptedBackend):
        live = peak = 0

        async def complete(self, request: CompletionRequest) -> Completion:
            speculative = request.priority == SPECULATIVE and request.prompt.startswith("think")
            self.live += speculative
            self.peak = max(self.peak, self.live)
            try:
                return await super().complete(request)
            finally:
                self.live -= speculative

    config = TreeSearchConfig("rest-mcts", budget=12, max_children=6, rest_children=3, dfs_speculation="fold")
    budget, backend = SharedBudget(k_total=4), Counting(0)
    _, explorer = search_on(backend, mcts_search, config, budget)
    assert explorer.counters.speculated > 0 and explorer.counters.budget_peak <= 4
    assert backend.peak <= 4  # generations running speculatively at once (one rollout of 3 fits in k_total 4)
    assert budget.in_flight.get(0, 0) == 0


def test_a_promoted_fold_rollout_raises_its_running_step_to_primary() -> None:
    config = TreeSearchConfig("rstar", budget=12, max_children=3, dfs_speculation="fold")
    promoted = []
    for seed in range(24):  # toy trees and latencies: a selection reaches a running speculative rollout in some
        _, _, backend = run(
            mcts_search, lambda e: Explorer(e, SharedBudget(k_total=3)), config, seed=seed, run_seed=seed
        )
        speculative = [r for r in backend.log if r.priority == SPECULATIVE]
        assert all(r.live_priority is not None for r in speculative)  # every step of a speculative rollout
        promoted += [r for r in speculative if r.live_priority.value == PRIMARY]
    assert promoted  # raised while (or before) it ran, not only the rollout's next steps


def test_equal_states_are_counted_as_the_expansions_the_search_used() -> None:
    """Two frontier nodes of one state share the explorer's jobs; the plain search expands both, and the saving
    rate's denominator counts both."""

    class Narrow(ScriptedBackend):
        async def complete(self, request: CompletionRequest) -> Completion:
            out = await super().complete(request)
            if request.prompt.startswith("think"):
                return Completion(f"w{_digest(request.seed) % 2}", "stop", 4, 2)
            return out

    config = TreeSearchConfig("rebase", budget=6)
    for seed in range(3):
        result, explorer = search_on(Narrow(seed), reward_balanced_search, config, SharedBudget(k_total=4))
        assert explorer.counters.expansions_used == len(result.expansions)


@pytest.mark.parametrize("algorithm", ["rstar", "rest-mcts"])
def test_mcts_rollouts_reach_the_tasks_depth(algorithm) -> None:
    """A task of depth 7 (Blocksworld's 6-step plans) is searched 7 deep; a cap at 5 made such plans impossible."""

    class Deep(ToyTask):
        depth = 7

        def is_final(self, problem, state):
            return len(state) >= self.depth

    config = TreeSearchConfig(algorithm, budget=3, max_children=2, rest_children=2)

    async def main():
        source = PlainSource(Expander(Deep(), PROBLEM, ScriptedBackend(), "self_eval", seed=7))
        return await mcts_search(Deep(), PROBLEM, source, config)

    result = run_virtual(main())
    assert {len(leaf.state) for leaf in result.leaves} == {7}


@pytest.mark.parametrize("algorithm", ["rebase", "rstar", "rest-mcts"])
def test_a_search_cut_by_its_depth_limit_votes_with_what_the_open_states_answer(algorithm) -> None:
    """max_depth below the task's: the open states are the leaves, answering what the task reads in them (they
    carried no answer, so the vote was empty: REBASE fell back to them, MCTS answered "")."""

    class Reads(ToyTask):
        def is_final(self, problem, state):
            return len(state) >= self.depth

        def final_answer(self, problem, state):
            return state[-1]

    config = TreeSearchConfig(algorithm, budget=3, max_depth=1, max_children=2, rest_children=2)
    search = reward_balanced_search if algorithm == "rebase" else mcts_search

    async def main():
        source = PlainSource(Expander(Reads(), PROBLEM, ScriptedBackend(), "self_eval", seed=7))
        return await search(Reads(), PROBLEM, source, config)

    result = run_virtual(main())
    assert result.leaves and all(leaf.answer == leaf.state[-1] for leaf in result.leaves)
    assert result.answer != ""


def test_an_mcts_rollout_cut_by_the_depth_limit_backs_up_no_reward() -> None:
    """Only an answer earns a reward (rStar's rule): an unanswered rollout backed up its last step's self-evaluation,
    so UCT returned to good-looking steps that never reach an answer."""
    tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, 2, 1, 1)
    cut, answered = _claim(tree, (0,)), _claim(tree, (0,))
    cut.chain = [[Child.make_dummy((), 0, reward=0.9)]]
    answered.chain = [[Child.make_dummy((), 1, reward=0.6, final=True, answer="7")]]
    _fold(tree, cut), _fold(tree, answered)
    assert tree.stats.visits[0] == 2 and tree.stats.value[0] == pytest.approx(0.6)


def test_rest_mcts_values_rollouts_by_process_rewards_and_weighs_children_by_visits() -> None:
    """REST-MCTS* backed up rStar's running mean of terminal rewards (the weighted update was not built). Now a
    rollout a (0.4) -> b (0.9, answered) is worth 0.5 * 0.4 + 0.5 * 0.9 at b and at a; a one-step rollout c (0.2)
    its own reward; the root the visit-weighted mean of a and c; selection coming back to the dead end c backs up
    c's value again; a rollout the depth limit cut before an answer is worth 0."""
    tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, 3, 1, 2, alpha=0.5)
    first, second = _claim(tree, (0,)), _claim(tree, (0,))
    a = replace(Child.make_dummy((), 0, reward=0.4), final=False)
    first.chain = [[a], [Child.make_dummy(a.state, 0, reward=0.9, final=True, answer="7", at=(0, 0))]]
    second.chain = [[Child.make_dummy((), 1, reward=0.2, final=True, answer="8")]]
    _fold(tree, first), _fold(tree, second)
    a_id, b_id, c_id = 1, 2, 3
    assert [tree.stats.stats(n).q for n in (b_id, a_id, c_id)] == pytest.approx([0.65, 0.65, 0.2])
    assert tree.stats.stats(0).q == pytest.approx((0.65 + 0.2) / 2)
    tree.back_up((0, c_id), tree.dead_end(c_id))
    assert tree.stats.stats(c_id).q == pytest.approx(0.2) and tree.stats.stats(0).q == pytest.approx(1.05 / 3)
    cut = _claim(tree, (0,))
    cut.chain = [[replace(Child.make_dummy((), 2, reward=0.9), final=False)], [replace(a, final=False)]]
    assert tree.rollout(cut.chain) == 0.0
    # rStar's tree, the same rollouts: the running mean of the terminal rewards (0.9 through a, 0.2 at c)
    plain = _Tree(MctsTree(children={}), {0: root_child()}, {}, 3, 1, 2)
    first.path = second.path = (0,)
    _fold(plain, first), _fold(plain, second)
    assert plain.stats.stats(1).q == pytest.approx(0.9) and plain.stats.stats(0).q == pytest.approx(0.55)


def test_a_task_of_plain_text_prompts_asks_for_completions_not_chats() -> None:
    """Blocksworld's few-shot prompts are continuations: its requests go as text (chat=False), others as chats."""
    from spectot.tasks.blocksworld import BlocksworldTask

    assert BlocksworldTask.chat is False and ToyTask.chat is True

    class Text(ToyTask):
        chat = False

    for task, chat in ((ToyTask(), True), (Text(), False)):
        backend = ScriptedBackend()

        async def main(task=task, backend=backend):
            source = PlainSource(Expander(task, PROBLEM, backend, "self_eval", seed=7))
            return await reward_balanced_search(task, PROBLEM, source, TreeSearchConfig("rebase", budget=2))

        run_virtual(main())
        assert backend.log and {r.chat for r in backend.log} == {chat}


def test_early_stop_ends_the_search_once_the_vote_is_settled() -> None:
    config = TreeSearchConfig("rstar", budget=30, max_children=3)
    stopped = 0
    for run_seed in range(6):  # toy trees: some settle early, some never do
        full, _, _ = run(mcts_search, PlainSource, config, run_seed=run_seed)
        stop = lambda groups, n: settled(groups, n, 3, 0.5)  # noqa: E731
        short, _, _ = run(mcts_search, PlainSource, config, stop=stop, run_seed=run_seed)
        assert not full.stopped_early
        if short.stopped_early:
            stopped += 1
            assert len(short.leaves) < len(full.leaves)
        states = [c.state for c in short.leaves]
        assert states == [c.state for c in full.leaves[: len(states)]]  # the same search, cut short
    assert stopped


def test_queries_share_the_budget_and_every_query_finishes() -> None:
    problems = [Problem(f"p{i}", "toy", "1") for i in range(6)]
    explore = ExploreConfig("spex", k_total=4)

    async def main():
        backend = ScriptedBackend(3)
        records = [
            r async for r in run_queries(ToyTask(), problems, backend, TreeSearchConfig(budget=4), explore, in_flight=3)
        ]
        return records

    records = run_virtual(main())
    assert sorted(r.id for r in records) == [p.id for p in problems]
    assert all(r.spec["budget_peak"] <= 4 for r in records)


@pytest.mark.parametrize(
    ("sampling", "thought", "evaluation"),
    [(None, (1.0, 1.0), (0.0, 1.0)), (ExpansionSampling(0.7, 0.9, 0.2), (0.7, 0.9), (0.2, 1.0))],
)
def test_expansions_sample_as_configured(sampling, thought, evaluation) -> None:
    backend = ScriptedBackend(5)

    async def main():
        config, explore = TreeSearchConfig(budget=3), ExploreConfig("spex", k_total=3)
        return [r async for r in run_queries(ToyTask(), [PROBLEM], backend, config, explore, sampling=sampling)]

    run_virtual(main())
    asked = {(r.prompt.split("|")[0], r.temperature, r.top_p) for r in backend.log}
    assert asked == {("think", *thought), ("value", *evaluation)}


class TwoStepBackend(ScriptedBackend):
    """Every thought is one of two words (as Blocksworld's few legal actions): nodes whose steps read alike."""

    async def complete(self, request: CompletionRequest) -> Completion:
        out = await super().complete(request)
        if request.prompt.startswith("think"):
            return replace(out, text=f"w{_digest(request.prompt, request.seed) % 2}")
        return out


@pytest.mark.parametrize("algorithm", ["rebase", "rstar", "rest-mcts"])
def test_nodes_whose_steps_read_alike_sample_their_own_children(algorithm: str) -> None:
    """Children were keyed by their parent's text: two nodes reading "w1" drew the same children (32 thought
    requests, 14 distinct for REBASE), and SPEX's cache ran each duplicate once where plain ran it twice."""
    config = TreeSearchConfig(algorithm, budget=8, max_children=3, rest_children=2)
    requests = {}
    for explore in (False, True):
        backend = TwoStepBackend(0)

        async def main(backend=backend, explore=explore):
            expander = Expander(ToyTask(), PROBLEM, backend, "self_eval", seed=7)
            source = Explorer(expander, SharedBudget(k_total=8), lookahead=2) if explore else PlainSource(expander)
            search = reward_balanced_search if algorithm == "rebase" else mcts_search
            try:
                return await search(ToyTask(), PROBLEM, source, config, None)
            finally:
                await source.close()

        result = run_virtual(main())
        if not explore:  # (SPEX may run a request again after cancelling it)
            thoughts = [(r.prompt, r.seed) for r in backend.log if r.prompt.startswith("think")]
            assert len(set(thoughts)) == len(thoughts)  # no two expansions share a prompt and a seed
        states = [c.state for c in result.expansions]
        assert len(set(states)) < len(states)  # steps read alike: the tree holds equal states
        requests[explore] = [c.key for c in result.expansions]
    assert requests[True] == requests[False]  # speculation changed nothing


def test_rest_mcts_gives_a_node_all_its_children_when_the_width_does_not_divide_them() -> None:
    """--max-children 3 --rest-children 2 (the defaults): a node's last step expands the one child left (it
    stopped at 2 children: the limit was rounded down to a multiple of the width)."""
    from collections import Counter

    config = TreeSearchConfig("rest-mcts", budget=12, max_children=3, rest_children=2)
    result, _, _ = run(mcts_search, PlainSource, config)
    children = Counter(c.key.at for c in result.expansions)
    assert max(children.values()) == 3
    assert all(sorted(c.key.index for c in result.expansions if c.key.at == at) == list(range(n))
               for at, n in children.items())  # fmt: skip


def test_an_expansion_cancelled_during_its_reward_counts_its_thought() -> None:
    """Tokens were counted once thought and reward had both finished: a speculative expansion cancelled while its
    self-evaluation ran lost its whole thought from the query's tokens and from the waste."""

    class SlowReward:
        name = "slow-reward"

        async def complete(self, request):
            thought = request.prompt.startswith("think")
            await asyncio.sleep(0.01 if thought else 10.0)
            return Completion("w1" if thought else "5", "stop", 4, 300 if thought else 2)

    async def main():
        expander = Expander(ToyTask(), PROBLEM, SlowReward())
        explorer = Explorer(expander, None)
        task = asyncio.create_task(expander.expand(ChildKey((), 0)))
        await asyncio.sleep(0.1)  # the thought is done, its evaluation runs
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await explorer.close()
        return expander.counters, explorer.counters

    counters, spec = asyncio.run(main())
    assert (counters.tokens, counters.cancelled_tokens, counters.expansions) == (300, 300, 0)
    assert spec.wasted_tokens == 300


def test_a_fold_rollout_that_fails_is_a_failure_not_a_cancellation() -> None:
    """A fold rollout promoted to primary counted a hit; failing, it was also counted cancelled (and its tokens
    wasted): a rollout both used and cancelled. One never promoted counted cancelled, and ``failed`` stayed 0."""
    explorer = Explorer(Expander(ToyTask(), PROBLEM, ScriptedBackend()), None)
    steps = [Child.make_dummy((), 0), Child.make_dummy((), 1)]
    explorer.dropped(steps, failed=True)
    counters = explorer.counters
    assert (counters.cancelled, counters.failed, counters.wasted_tokens) == (0, 1, 20)
    explorer.dropped(steps)
    assert (counters.cancelled, counters.failed, counters.wasted_tokens) == (1, 1, 40)


def test_an_answered_rest_sibling_selected_unvisited_backs_up_its_reward() -> None:
    """The weighted rule read an unvisited node's value as Q = 0: a REST step's answered sibling (kept out of
    the rollout, unvisited) backed up 0 when UCT selected it, and stayed 0 on every later visit."""
    tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, 3, 2, 3, alpha=0.5)
    rollout = _claim(tree, (0,))
    kept = Child.make_dummy((), 0, reward=0.9, final=True, answer="7")
    sibling = Child.make_dummy((), 1, reward=0.95, final=True, answer="8")
    rollout.chain = [[kept, sibling]]
    _fold(tree, rollout)
    assert tree.stats.visits.get(2, 0.0) == 0 and tree.dead_end(2) == pytest.approx(0.95)
    tree.back_up((0, 2), tree.dead_end(2))
    assert tree.dead_end(2) == pytest.approx(0.95) and tree.stats.stats(0).q == pytest.approx((0.9 + 0.95) / 2)


def test_a_failed_fold_rollout_gives_its_child_index_back(monkeypatch) -> None:
    """A speculative fold rollout that failed kept its child indices: a node whose only indices it took was left
    open with no children and no index, and UCT kept selecting it as a dead end worth 0 (each one of the budgeted
    simulations); the failure was counted cancelled, not failed."""
    import spectot.search.mcts as mcts

    class Deep(ToyTask):
        depth = 6

    burnt = []
    dead_end = mcts._Tree.dead_end

    def spy(tree, node):
        if not tree.nodes[node].final and len(tree.nodes[node].state) < tree.max_depth:
            burnt.append(node)  # an open node selected as a dead end: its indices were taken and never used
        return dead_end(tree, node)

    monkeypatch.setattr(mcts._Tree, "dead_end", spy)
    config = TreeSearchConfig("rest-mcts", budget=16, max_children=2, rest_children=2, dfs_speculation="fold")
    backend = FlakyBackend(seed=2, failures=3)

    async def main():
        explorer = Explorer(Expander(Deep(), PROBLEM, backend, "self_eval", seed=2), SharedBudget(k_total=8))
        try:
            return await mcts_search(Deep(), PROBLEM, explorer, config), explorer
        finally:
            await explorer.close()

    _, explorer = run_virtual(main())
    assert backend.failures == 0 and burnt == []
    assert explorer.counters.failed >= 1 and explorer.counters.cancelled == 0


def test_a_free_node_hands_a_returned_index_out_first() -> None:
    tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, 2, 2, 3)
    assert tree.claim(0) == 0 and not tree.free(0)  # width 2 of 2 children: the node is full
    tree.give_back(0, 0)
    assert tree.free(0) and tree.claim(0) == 0 and not tree.free(0)


@pytest.mark.parametrize("mode", ["exact", "fold"])
def test_a_cancelled_mcts_search_stops_its_rollout(mode) -> None:
    """Cancelling the search (another query failed) cancelled the pre-runs only: its own rollout went on asking
    for its next steps (2 requests at the cancel, 6 twenty seconds later), and a wait task stayed alive."""
    backend = ScriptedBackend(0, max_latency=1.0)

    async def main():
        source = PlainSource(Expander(ToyTask(), PROBLEM, backend, "self_eval", seed=7))
        config = TreeSearchConfig("rstar", budget=8, max_depth=6, dfs_speculation=mode)
        search = asyncio.create_task(mcts_search(ToyTask(), PROBLEM, source, config))
        await asyncio.sleep(1.5)
        search.cancel()
        await asyncio.gather(search, return_exceptions=True)
        at_cancel = len(backend.log)
        await asyncio.sleep(20)
        alive = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return at_cancel, len(backend.log), alive

    at_cancel, later, alive = run_virtual(main())
    assert at_cancel > 0 and later == at_cancel and alive == []


def test_a_closed_explorer_refuses_expansions() -> None:
    explorer = Explorer(Expander(ToyTask(), PROBLEM, ScriptedBackend()), None)
    run_virtual(explorer.close())
    with pytest.raises(RuntimeError, match="closed: its search is over"):
        run_virtual(explorer.expand(ChildKey((), 0)))


def test_a_failed_primary_expansion_runs_afresh_when_asked_again() -> None:
    """A failed primary expansion stayed in the explorer's cache: a fold rollout that failed gave its child index
    back, the next rollout asked for the same keys, met the stored failure and failed the search."""

    class FailsOnce(ScriptedBackend):
        async def complete(self, request: CompletionRequest) -> Completion:
            if not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("a timeout")
            return await super().complete(request)

    explorer = Explorer(Expander(ToyTask(), PROBLEM, FailsOnce()), None)

    async def main():
        with pytest.raises(RuntimeError, match="a timeout"):
            await explorer.expand(ChildKey((), 0))
        return await explorer.expand(ChildKey((), 0))

    assert run_virtual(main()).key == ChildKey((), 0)


@pytest.mark.parametrize("alpha", [None, 0.5])  # rStar, REST-MCTS*
def test_an_mcts_rollout_ending_at_the_tasks_last_step_without_an_answer_backs_up_no_reward(alpha) -> None:
    """The math tasks count a state at their depth as final, answered or not, and the CLI gives the search the
    task's depth: so the depth limit's 0 never applied, and a last step that says no answer backed up its
    self-evaluation (0.9 here, against the answered sibling's 0.6), where rStar gives such a terminal 0."""
    tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, 2, 1, 1, alpha=alpha)
    unanswered, answered = _claim(tree, (0,)), _claim(tree, (0,))
    unanswered.chain = [[Child.make_dummy((), 0, reward=0.9, final=True, answer="")]]
    answered.chain = [[Child.make_dummy((), 1, reward=0.6, final=True, answer="7")]]
    _fold(tree, unanswered), _fold(tree, answered)
    assert tree.stats.stats(0).q == pytest.approx(0.3) and tree.stats.stats(1).q == 0.0
    assert tree.dead_end(1) == 0.0 and tree.dead_end(2) == pytest.approx(0.6)


def test_rest_mcts_keeps_an_answered_step_over_a_better_rated_last_step_that_answers_nothing() -> None:
    """A step's children ranked by raw reward: a last step with no answer (0.9) was kept over an answered one (0.6),
    and the rollout then backed up 0 while the answer only voted; tied at 0, the lower index won the same way; an
    open child at the depth limit ends the rollout unanswered too."""
    from spectot.search.mcts import _rollout

    def kept(unanswered: Child, answered: Child) -> tuple[list[str], float]:
        children = {0: unanswered, 1: answered}

        class Source:
            async def expand(self, key, priority=PRIMARY):
                return children[key.index]

        tree = _Tree(MctsTree(children={}), {0: root_child()}, {}, 2, 2, 1, alpha=0.5)
        rollout = _claim(tree, (0,))
        asyncio.run(_rollout(Source(), tree, tree.nodes[0], rollout))
        return [c.answer for c in rollout.chain[0]], tree.rollout(rollout.chain)

    answered = Child.make_dummy((), 1, reward=0.6, final=True, answer="7")
    assert kept(Child.make_dummy((), 0, reward=0.9, final=True), answered) == (["7", ""], pytest.approx(0.6))
    tied = kept(Child.make_dummy((), 0, reward=0.0, final=True), replace(answered, reward=0.0))
    assert tied[0] == ["7", ""]
    assert kept(Child.make_dummy((), 0, reward=0.9), answered)[0] == ["7", ""]  # open, cut by max_depth 1
