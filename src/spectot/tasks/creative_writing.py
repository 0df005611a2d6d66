"""Tree-of-Thoughts Creative Writing (Yao et al. 2023): inputs and the chain-of-thought prompt.

Each input line holds four sentences; the passage's four paragraphs must end with them, in order.
The prompt is the ToT repository's ``cot_prompt`` (src/tot/prompts/text.py), paraphrase-free
because models were evaluated with exactly this text.
"""

from __future__ import annotations

import re
from pathlib import Path

from spectot.data.jsonl import DataError
from spectot.tasks.base import Problem, State, StepRequest, Task

COT_PROMPT = (
    "Write a coherent passage of 4 short paragraphs. The end sentence of each paragraph must be: {input}\n\n"
    "Make a plan then write. Your output should be of the following format:\n\nPlan:\nYour plan here.\n\n"
    "Passage:\nYour passage here."
)


def read_inputs(path: str | Path, offset: int = 0, limit: int = 0) -> list[str]:
    """Lines ``offset``, ``offset + 1``, ... (``limit`` of them, 0 = all) of a ToT text file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    lines = path.read_text(encoding="utf-8").split("\n")
    picked = []
    for number, line in enumerate(lines, start=1):
        if number <= offset:
            continue
        if not line.strip():
            continue
        picked.append(line)
        if limit and len(picked) == limit:
            break
    return picked


def cot_prompt(sentences: str) -> str:
    return COT_PROMPT.format(input=sentences + "\n")


# -- Tree-of-Thoughts task: depth 2, a plan then the passage ------------------------------------------
PLAN_PROMPT = (
    "Write a coherent passage of 4 short paragraphs. The end sentence of each paragraph must be: {input}\n\n"
    "First write a short plan for the passage (one line per paragraph). Output only the plan."
)
PASSAGE_PROMPT = (
    "Write a coherent passage of 4 short paragraphs. The end sentence of each paragraph must be: {input}\n\n"
    "Follow this plan:\n{plan}\n\nOutput only the passage, paragraphs separated by blank lines."
)
SCORE_PROMPT = (
    'Analyze the following {what}, then at the last line conclude "Thus the coherency score is {{s}}", where '
    "s is an integer from 1 to 10.\n\n{text}"
)


class CreativeWritingTask(Task):
    """ToT Creative Writing: G writes a plan, then a passage following it; E scores coherency 1-10.

    The metric has two parts: ``grade`` is the share of paragraphs that end with their required
    sentence (checked, not judged), and the coherency score E gives the chosen passage is reported
    beside it (ToT used GPT-4 as that judge; here it is the target itself).
    """

    name = "creative_writing"
    depth = 2

    def __init__(self, plan_tokens: int = 160, passage_tokens: int = 480) -> None:
        self.plan_tokens, self.passage_tokens = plan_tokens, passage_tokens

    def thought(self, problem: Problem, state: State) -> StepRequest:
        sentences = problem.question + "\n"
        if not state:
            return StepRequest(PLAN_PROMPT.format(input=sentences), (), self.plan_tokens)
        return StepRequest(PASSAGE_PROMPT.format(input=sentences, plan=state[0]), (), self.passage_tokens)

    def parse_thought(self, problem: Problem, state: State, text: str) -> str:
        return text.strip()

    def value(self, problem: Problem, state: State) -> StepRequest:
        what = "plan" if len(state) == 1 else "passage"
        return StepRequest(SCORE_PROMPT.format(what=what, text=state[-1]), (), 96)

    def parse_value(self, text: str) -> float:
        match = re.findall(r"coherency score is\D{0,3}(\d+)", text, flags=re.IGNORECASE) or re.findall(r"\d+", text)
        return float(min(10, max(1, int(match[-1])))) if match else 1.0

    def is_final(self, problem: Problem, state: State) -> bool:
        return len(state) >= self.depth

    def final_answer(self, problem: Problem, state: State) -> str:
        return state[-1] if len(state) >= self.depth else ""

    def grade(self, problem: Problem, answer: str) -> float:
        return paragraph_endings(answer, problem.answer)


def required_sentences(line: str) -> list[str]:
    """The four sentences of an input line (split after ., ! or ? followed by a space)."""
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", line.strip()) if s.strip()]


def paragraph_endings(passage: str, sentences: list[str]) -> float:
    """Share of required sentences that end their paragraph, in order (paragraph i ends with sentence i)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", passage.strip()) if p.strip()]
    if not sentences:
        return 0.0
    hits = sum(1 for i, s in enumerate(sentences) if i < len(paragraphs) and _norm(paragraphs[i]).endswith(_norm(s)))
    return hits / len(sentences)


def _norm(text: str) -> str:
    return " ".join(text.replace("\u2019", "'").split()).lower()


def load_problems(path: str | Path, limit: int = 0, offset: int = 0) -> list[Problem]:
    lines = read_inputs(path, offset, limit)
    return [Problem(f"line-{offset + i + 1}", line, required_sentences(line)) for i, line in enumerate(lines)]
