"""The task interface every reasoning task implements (llm-reasoners' split: task | policy | search).

A *task* owns its data and its text: how a problem is read, what prompt asks for the next reasoning
step (the Thought Generator G) and what prompt asks to judge a partial solution (the State Evaluator
E), how model output is parsed, and how a final answer is graded. It holds no model code, so a search
algorithm can run any task over any backend (the local engine or an OpenAI-compatible server).

A *state* is the tuple of steps taken so far (strings). A step is one model output: a sub-question
and its sub-answer (GSM8K), a plan or a passage (Creative Writing), one action (Blocksworld).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
import re
from typing import Any

State = tuple[str, ...]


@dataclass(frozen=True)
class Problem:
    id: str  # stable within its file: the line number or instance name
    question: str
    answer: Any  # the gold answer in the task's own form (a number string, a plan, required sentences)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make_dummy(cls, question: str = "What is 2 + 3?", answer: Any = "5") -> Problem:
        return cls("dummy-1", question, answer)


@dataclass(frozen=True)
class StepRequest:
    """One generation the task asks for: a prompt, the strings that end it and its token budget."""

    prompt: str
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 128


VOTE_PROMPT = (  # ToT's vote prompt (Yao et al. 2023, src/tot/prompts/text.py), for any task
    "Given an instruction and several choices, decide which choice is most promising. Analyze each choice in "
    'detail, then conclude in the last line "The best choice is {{s}}", where s the integer id of the choice.\n\n'
    "Instruction:\n{question}\n\n{choices}"
)
PROPOSE_PROMPT = (
    "{question}\n\nSteps so far:\n{steps}\n\nPropose {n} different possible next steps, one per line, "
    "each starting with 'Step:'.{last}\n"
)


# "Step: a", "Step 2: a", "1. Step: a", "Step 3. a", and markdown's "**Step 1:** a", "**Step 2**: a", "- Step: a",
# "* **Step:** a", "**Step 1: a**" (emphasis around the label or the whole line; "Step: *Note* a" keeps its own)
PROPOSAL_LABEL = re.compile(
    r"[\s*\-•]*(?:\d+[.)]\s*)?\**\s*step\s*\d*\s*\**\s*[:.]\s*(?:\*+(?=\s))?\s*(.*?)\s*(?:(?<=\S)\*\*)?\s*$",
    re.IGNORECASE,
)
# "The best choice is 2", "... is Choice 2", "... is: **Choice 2**", '... is "Choice 1"' (markdown and quotes)
VOTE_CONCLUSION = re.compile(r"best choice is\W{0,6}(?:choice\W{0,3})?(\d+)", re.IGNORECASE)


class Task:
    """The base every task extends; ``vote`` and ``propose`` have generic defaults a task may override."""

    name: str = "task"
    depth: int = 1  # T: the number of steps to a complete solution
    value_range: tuple[float, float] = (1.0, 10.0)  # what parse_value returns: lowest, highest
    chat: bool = True  # prompts are user messages (an instruct model's chat template); False: plain-text continuations

    def thought(self, problem: Problem, state: State) -> StepRequest:
        """The prompt for G: the next step after ``state``."""
        ...

    def parse_thought(self, problem: Problem, state: State, text: str) -> str:
        """The step to append, from G's raw output (trimmed, normalised)."""
        ...

    def value(self, problem: Problem, state: State) -> StepRequest:
        """The prompt for E: a judgement of ``state`` (it has at least one step)."""
        ...

    def parse_value(self, text: str) -> float:
        """E's output -> a score; unparseable output scores the task's lowest value, never raises."""
        ...

    def is_final(self, problem: Problem, state: State) -> bool:
        """Whether ``state`` is a complete solution (the search stops expanding it)."""
        ...

    def final_answer(self, problem: Problem, state: State) -> str:
        """The answer a complete (or the best partial) state gives."""
        ...

    def grade(self, problem: Problem, answer: str) -> float:
        """The task's metric for one answer: 1.0 / 0.0 for accuracy tasks, a score otherwise."""
        ...

    def same_answer(self, a: str, b: str) -> bool:
        """Whether two final answers are the same answer (votes over leaves group by it)."""
        return a.strip() == b.strip()

    def check_problems(self, problems: Sequence[Problem]) -> None:
        """Refuse problems the task's own prompts already answer (a few-shot demo among them); none by default."""

    # -- generic defaults: generation by `propose`, evaluation by `vote` ---------------------------
    # what the proposals of a state's last step must do (state the answer as final_answer reads it); None: the
    # task's steps are not one-line proposals (generate them by sampling)
    last_proposals: str | None = ""

    def propose(self, problem: Problem, state: State, n: int) -> StepRequest:
        """One prompt for G that lists ``n`` candidate next steps at once (ToT's `propose`); for the last step
        the task's ``last_proposals`` instruction is added (without it no proposal stated the final answer)."""
        if self.last_proposals is None:
            raise ValueError(f"{self.name}'s steps are not one-line proposals: sample them (generation 'sample')")
        steps = "\n".join(state) or "(none)"
        last = " " + self.last_proposals if self.last_proposals and len(state) >= self.depth - 1 else ""
        return StepRequest(PROPOSE_PROMPT.format(question=problem.question, steps=steps, n=n, last=last), (), 64 * n)

    def parse_proposals(self, problem: Problem, state: State, text: str) -> list[str]:
        """The proposed steps: lines labelled 'Step:' as asked, or as models also write them ('Step 2: ...',
        '1. Step: ...', 'Step 3. ...'); without any label, the first non-empty line."""
        lines = [line.strip() for line in text.splitlines()]
        steps = [m.group(1).strip() for line in lines if (m := PROPOSAL_LABEL.match(line))]
        return [s for s in steps if s] or [s for s in lines if s][:1]

    def vote(self, problem: Problem, candidates: list[State]) -> StepRequest:
        """One prompt for E that picks the most promising of ``candidates`` (ToT's `vote`)."""
        choices = "\n".join(f"Choice {i}:\n{chr(10).join(c)}\n" for i, c in enumerate(candidates, start=1))
        return StepRequest(VOTE_PROMPT.format(question=problem.question, choices=choices), (), 256)

    def parse_vote(self, text: str, n: int) -> int | None:
        """The 0-based index E voted for (its last "The best choice is [Choice] s", as ToT's regex reads the
        conclusion the prompt asks for on the last line), or None when the output names no valid choice."""
        matches = VOTE_CONCLUSION.findall(text)
        if not matches or not 1 <= int(matches[-1]) <= n:
            return None
        return int(matches[-1]) - 1
