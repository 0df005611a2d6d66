"""ToT-BFS on a scripted backend: expansion, evaluation, selection of the b best, final states, votes.

The backend is scripted (it answers prompts from a table), the search is the real one: what is
checked is which prompts BFS asks for, level by level, and which states it keeps.
"""

from __future__ import annotations

import pytest

from spectot.search.policy import GenerationCall, Policy, cut_at_stop, stream_seeds
from spectot.search.tot_bfs import BfsConfig, Node, select_best, tally_votes, tot_bfs
from spectot.tasks.base import Problem, State, StepRequest, Task


class CountingTask(Task):
    """A state is a list of digits; E's value of a state is its last digit; final at 3 steps or a 9."""

    name = "counting"
    depth = 3

    def thought(self, problem: Problem, state: State) -> StepRequest:
        return StepRequest("G:" + ",".join(state), ("\n",), 4)

    def parse_thought(self, problem: Problem, state: State, text: str) -> str:
        return text.strip()

    def value(self, problem: Problem, state: State) -> StepRequest:
        return StepRequest("E:" + ",".join(state), ("\n",), 2)

    def parse_value(self, text: str) -> float:
        return float(text) if text.strip().isdigit() else 0.0

    def is_final(self, problem: Problem, state: State) -> bool:
        return len(state) >= self.depth or (bool(state) and state[-1] == "9")

    def final_answer(self, problem: Problem, state: State) -> str:
        return ",".join(state)

    def grade(self, problem: Problem, answer: str) -> float:
        return float(answer == problem.answer)


class ScriptedBackend:
    """G's k-th call for a prompt returns script[prompt][k % len]; E echoes the state's last digit."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script, self.calls, self.seen = script, {}, []

    def generate(self, call: GenerationCall) -> list[str]:
        self.seen.append(call)
        out = []
        for r in call.requests:
            if r.prompt.startswith("E:"):
                out.append(r.prompt.rsplit(",", 1)[-1].removeprefix("E:"))
                continue
            k = self.calls.get(r.prompt, 0)
            self.calls[r.prompt] = k + 1
            options = self.script[r.prompt]
            out.append(options[k % len(options)])
        return out


SCRIPT = {"G:": ["3", "7", "5"], "G:7": ["1", "4", "2"], "G:7,4": ["8", "6", "0"], "G:5": ["9", "2", "1"]}


def test_bfs_keeps_the_best_state_each_level() -> None:
    backend = ScriptedBackend(SCRIPT)
    result = tot_bfs(CountingTask(), Problem("p", "count", "7,4,8"), Policy(backend), BfsConfig(breadth=1, thoughts=3))
    assert result.kept == [[("7",)], [("7", "4")], [("7", "4", "8")]]
    assert result.answer == "7,4,8"
    assert [c.component for c in backend.seen] == ["TG", "SE"] * 3
    assert all(len(c.requests) == 3 for c in backend.seen)  # a whole level per call


def test_breadth_two_expands_both_and_final_states_compete() -> None:
    backend = ScriptedBackend(SCRIPT)
    result = tot_bfs(CountingTask(), Problem("p", "count", ""), Policy(backend), BfsConfig(breadth=2, thoughts=3))
    assert result.kept[0] == [("7",), ("5",)]
    # level 2: children of 7 (1, 4, 2) and of 5 (9, 2, 1); "5,9" is final with value 9 and wins
    assert result.kept[1][0] == ("5", "9")
    assert len(backend.seen[2].requests) == 6
    # level 3 expands only the open state "7,4"; the final "5,9" (value 9) stays ahead of "7,4,8"
    assert result.best.state == ("5", "9")
    assert backend.seen[4].requests[0].prompt == "G:7,4"


def test_a_state_met_again_in_a_level_scores_zero() -> None:
    """ToT's value cache: b copies of one state filled every slot and the search ran b times over one branch (the
    '5' branch was lost)."""
    script = {"G:": ["7", "7", "5"], "G:7": ["1", "4", "2"], "G:5": ["8", "2", "1"], "G:7,4": ["3"], "G:5,8": ["2"]}
    result = tot_bfs(CountingTask(), Problem("p", "", ""), Policy(ScriptedBackend(script)), BfsConfig(breadth=2))
    assert result.kept[0] == [("7",), ("5",)]
    assert [n.value for n in result.levels[0]] == [7.0, 0.0, 5.0]  # evaluated all the same (the seeds stay put)


class ChainingBackend(ScriptedBackend):
    """Runs each G request's follow-up right after it, one at a time, as a chaining engine may."""

    chains = True

    def generate_chained(self, first: GenerationCall, then: GenerationCall, follow) -> tuple[list[str], list[str]]:
        texts, judged = [], []
        for i, (request, seed) in enumerate(zip(first.requests, first.seeds)):
            [text] = self.generate(GenerationCall([request], first.temperature, [seed], "TG"))
            [j] = self.generate(GenerationCall([follow(i, text)], then.temperature, [then.seeds[i]], "SE"))
            texts.append(text)
            judged.append(j)
        return texts, judged


def test_a_chaining_backend_builds_the_same_tree_with_the_same_seeds() -> None:
    plain, chained = ScriptedBackend(SCRIPT), ChainingBackend(SCRIPT)
    problem = Problem("p", "count", "")
    want = tot_bfs(CountingTask(), problem, Policy(plain, seed=3), BfsConfig(breadth=2, thoughts=3))
    got = tot_bfs(CountingTask(), problem, Policy(chained, seed=3), BfsConfig(breadth=2, thoughts=3))
    assert got.kept == want.kept and got.answer == want.answer
    # every request got the seed the unchained policy gave it
    seeds = lambda backend: sorted((r.prompt, s) for c in backend.seen for r, s in zip(c.requests, c.seeds))  # noqa: E731
    assert seeds(chained) == seeds(plain)


def test_vote_evaluation_counts_votes() -> None:
    assert tally_votes([0, 2, None, 2], 3) == [1.0, 0.0, 2.0]

    class VoteBackend(ScriptedBackend):
        def generate(self, call):
            if call.component == "SE":
                return ["The best choice is 2"] * len(call.requests)
            return super().generate(call)

    result = tot_bfs(
        CountingTask(), Problem("p", "", ""), Policy(VoteBackend(SCRIPT)), BfsConfig(evaluation="vote", steps=1)
    )
    assert result.kept == [[("7",)]]


def test_select_best_is_stable_and_seeds_are_pure() -> None:
    nodes = [Node(("a",), 1.0), Node(("b",), 2.0), Node(("c",), 2.0)]
    assert [n.state for n in select_best(nodes, 2)] == [("b",), ("c",)]
    assert stream_seeds(0, "TG", "p", 1, n=3) == stream_seeds(0, "TG", "p", 1, n=3)
    assert stream_seeds(0, "TG", "p", 1, n=3) != stream_seeds(0, "TG", "p", 2, n=3)
    assert cut_at_stop("Step 1: x\nStep 2", ("\nStep",)) == "Step 1: x"


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="breadth"):
        BfsConfig(breadth=0)


def test_nothing_proposed_ends_the_search_instead_of_crashing() -> None:
    """Every proposal empty: the frontier would be empty (IndexError); the search ends where it stood."""

    class Silent(ScriptedBackend):
        def generate(self, call):
            return [""] * len(call.requests) if call.component == "TG" else super().generate(call)

    for evaluation in ("value", "vote"):
        config = BfsConfig(generation="propose", evaluation=evaluation, breadth=1, thoughts=2)
        result = tot_bfs(CountingTask(), Problem("p", "", ""), Policy(Silent(SCRIPT)), config)
        assert result.answer == "" and result.best.state == ()


def test_proposals_are_normalised_as_sampled_thoughts() -> None:
    """A proposed step goes through ``parse_thought`` as a sampled one does (Blocksworld renders its action,
    GSM8K drops a label); a step it empties is no child."""

    class Shouting(CountingTask):
        def parse_thought(self, problem: Problem, state: State, text: str) -> str:
            return text.strip().upper().replace("SKIP", "")

    class Proposer(ScriptedBackend):
        def generate(self, call):
            if call.component == "TG":
                return ["Step: a\nStep: skip\nStep: b"] * len(call.requests)
            return ["1"] * len(call.requests)

    config = BfsConfig(generation="propose", evaluation="value", breadth=3, thoughts=3, steps=1)
    result = tot_bfs(Shouting(), Problem("p", "", ""), Policy(Proposer(SCRIPT)), config)
    assert sorted(n.state for n in result.levels[0]) == [("A",), ("B",)]


def test_votes_and_proposals_are_read_as_models_write_them() -> None:
    task = CountingTask()
    assert task.parse_vote("Analysis...\nThe best choice is Choice 3", 4) == 2
    assert task.parse_vote("At first the best choice is 1, but on reflection the best choice is 2", 4) == 1
    assert task.parse_vote("The best choice is 5", 4) is None
    # markdown and quotes around the choice (read as none before: the vote counted for nothing)
    for text in ("The best choice is **Choice 2**", "The best choice is: Choice 2", 'The best choice is "Choice 2"'):
        assert task.parse_vote(text, 4) == 1, text
    assert task.parse_vote("The best choice is: **Choice 3**.", 4) == 2
    proposals = task.parse_proposals(Problem("p", "", ""), (), "Step 1: add\nStep 2: sub\n1. Step: mul\nstep: div")
    assert proposals == ["add", "sub", "mul", "div"]
    assert task.parse_proposals(Problem("p", "", ""), (), "no label\nsecond") == ["no label"]
    # markdown labels collapsed to one proposal, the first line, label and all
    for text in (
        "**Step 1:** a\n**Step 2:** b\n**Step 3:** c",
        "- Step: a\n- Step: b\n- Step: c",
        "* **Step:** a\nb\n* Step 2: b\n1. **Step 3:** c",
    ):
        assert task.parse_proposals(Problem("p", "", ""), (), text) == ["a", "b", "c"], text
    text = "**Step 1: Compute the total**\n**Step 2**: b\nStep: *Note* that x"
    assert task.parse_proposals(Problem("p", "", ""), (), text) == ["Compute the total", "b", "*Note* that x"]


def test_the_last_proposals_are_asked_for_the_final_answer() -> None:
    """The generic propose prompt never asked for the final answer: a GSM8K state ending in a proposed step was
    final at the depth limit and answered ''. Creative Writing's paragraphs are no one-line proposals."""
    from spectot.config import BackendOptions, DraftOptions, SearchOptions, SolveOptions, TreeSearchOptions, check_solve
    from spectot.tasks.creative_writing import CreativeWritingTask
    from spectot.tasks.gsm8k import FINAL_MARKER, Gsm8kTask
    from spectot.tasks.math500 import Math500Task

    problem = Problem("p", "What is 2 + 3?", "5")
    gsm8k, math = Gsm8kTask(depth=3), Math500Task(depth=3)
    assert FINAL_MARKER not in gsm8k.propose(problem, ("a",), 3).prompt
    assert f'each starts with "{FINAL_MARKER}:"' in gsm8k.propose(problem, ("a", "b"), 3).prompt
    assert "\\boxed{}" in math.propose(problem, ("a", "b"), 3).prompt
    with pytest.raises(ValueError, match="sample them"):
        CreativeWritingTask().propose(problem, (), 3)
    with pytest.raises(ValueError, match="Creative Writing's plans and passages are paragraphs"):
        check_solve(
            SearchOptions(generation="propose"),
            DraftOptions(),
            SolveOptions(task="creative_writing"),
            TreeSearchOptions(),
            BackendOptions(),
        )
