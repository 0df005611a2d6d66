"""The barrier and critical-path times of a searched tree (SPEX's ceiling), on hand-made trees."""

from dataclasses import replace

import pytest

from spectot.search.expansion import Child
from spectot.search.tree_search import critical_path_seconds, level_barrier_seconds


def _node(parent: Child | None, index: int, seconds: float) -> Child:
    if parent is None:
        return replace(Child.make_dummy((), index), seconds=seconds)
    return replace(Child.make_dummy(parent.state, index, at=parent.node), seconds=seconds)


def test_docstring_example_barrier_5_critical_path_4():
    a, b = _node(None, 0, 3.0), _node(None, 1, 1.0)
    a1, b1 = _node(a, 0, 1.0), _node(b, 0, 2.0)
    tree = [b1, a, a1, b]  # any order: children may be listed before their parents
    assert level_barrier_seconds(tree) == 5.0  # max(3, 1) + max(1, 2)
    assert critical_path_seconds(tree) == 4.0  # max(3 + 1, 1 + 2)


def test_a_chain_has_no_slack_and_one_level_is_its_slowest_node():
    chain = [_node(None, 0, 2.0)]
    for seconds in (1.5, 0.5):
        chain.append(_node(chain[-1], 0, seconds))
    assert level_barrier_seconds(chain) == critical_path_seconds(chain) == pytest.approx(4.0)
    level = [_node(None, i, s) for i, s in enumerate([0.5, 2.5, 1.0])]
    assert level_barrier_seconds(level) == critical_path_seconds(level) == 2.5
    assert level_barrier_seconds([]) == critical_path_seconds([]) == 0.0


def test_the_critical_path_follows_the_slow_branch_not_the_slowest_level_member():
    # depth 0: a 1 s, b 4 s; depth 1: a's child 4 s, b's child 1 s -> barrier 8 s, path max(5, 5) = 5 s
    a, b = _node(None, 0, 1.0), _node(None, 1, 4.0)
    tree = [a, b, _node(a, 0, 4.0), _node(b, 0, 1.0)]
    assert level_barrier_seconds(tree) == 8.0
    assert critical_path_seconds(tree) == 5.0


def test_early_termination_counts_answers_not_leaves():
    """A leaf without an answer (a rollout cut at the depth limit) casts no vote: one answer and three silent
    leaves are one answer, short of t = 4, however settled its lone group looks."""
    from spectot.explore.termination import settled
    from spectot.search.tree_search import stops
    from spectot.tasks.gsm8k import Gsm8kTask

    def rule(groups, n):
        return settled(groups, n, t=4)

    leaves = [Child.make_dummy((), 0, 0.9, True, "7")] + [Child.make_dummy((), i, 0.8, True) for i in (1, 2, 3)]
    assert not stops(rule, Gsm8kTask(), leaves)
    answered = [Child.make_dummy((), i, 0.8, True, "7") for i in range(4)]
    assert stops(rule, Gsm8kTask(), answered)
    assert not stops(None, Gsm8kTask(), answered) and not stops(rule, Gsm8kTask(), [])


def test_logprob_reward_needs_logprobs_for_a_step_of_tokens():
    import math

    from spectot.backends.base import Completion
    from spectot.search.expansion import logprob_reward

    assert logprob_reward(Completion("a b", "stop", 3, 2, [-0.5, -1.5])) == pytest.approx(math.exp(-1.0))
    assert logprob_reward(Completion("", "stop", 3, 0)) == 0.0  # an empty step: no confidence, not full
    with pytest.raises(ValueError, match="log-probs"):
        logprob_reward(Completion("a b", "stop", 3, 2))  # a backend that returned none would score 1


@pytest.mark.parametrize("value", [float("nan"), -0.5, 1.5])
def test_a_reward_model_is_held_to_the_unit_interval(value: float) -> None:
    """A pluggable reward outside [0, 1] is refused: a NaN wins votes and UCT choices, a negative weight lets the
    early-termination rule settle a tie (its margin alpha * avg(w_2nd) turns negative)."""
    import asyncio

    from spectot.backends.base import Completion
    from spectot.search.expansion import ChildKey, Expander
    from spectot.tasks.base import Problem
    from spectot.tasks.gsm8k import Gsm8kTask

    class OneStep:
        async def complete(self, request):
            return Completion("Step 1: 2 + 2 = 4.", "stop", 5, 8)

    problem = Problem("p", "What is 2 + 2?", "4")
    good = Expander(Gsm8kTask(), problem, OneStep(), reward=lambda p, s: 0.75)
    assert asyncio.run(good.expand(ChildKey((), 0))).reward == 0.75
    bad = Expander(Gsm8kTask(), problem, OneStep(), reward=lambda p, s: value)
    with pytest.raises(ValueError, match=r"reward model returned .* rewards lie in \[0, 1\]"):
        asyncio.run(bad.expand(ChildKey((), 0)))


def test_open_states_answer_when_the_finished_leaves_say_nothing() -> None:
    """At the depth limit the open states were read for an answer only when no leaf had finished: one finished
    leaf without an answer dropped them, and the search answered ''."""
    import asyncio

    from spectot.search.bfs import reward_balanced_search
    from spectot.search.tree_search import TreeSearchConfig
    from spectot.tasks.base import Problem, Task

    class Reading(Task):
        name, depth = "reading", 3

        def final_answer(self, problem, state):
            return state[-1].split()[-1] if state[-1][-1].isdigit() else ""

    class Scripted:
        async def level(self, keys, rule=None, budget=0):
            steps = [("gave up", True), ("so far 7", False)]
            return [Child(k, k.parent + (step,), step, 0.5, final, "", 1, 0.0) for k, (step, final) in zip(keys, steps)]

        def retain(self, keep, running_only=False):
            pass

    config = TreeSearchConfig("rebase", budget=2, max_depth=1)
    result = asyncio.run(reward_balanced_search(Reading(), Problem("p", "q", "7"), Scripted(), config))
    assert result.answer == "7"
