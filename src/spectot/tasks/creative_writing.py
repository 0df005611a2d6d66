"""Tree-of-Thoughts Creative Writing (Yao et al. 2023): inputs, the chain-of-thought prompt and the task.

Each input line holds four sentences; the passage's four paragraphs must end with them, in order.
``cot_prompt`` is the ToT repository's (src/tot/prompts/text.py) word for word: the one-pass prompt the draft
corpus and ``bench drafts`` use. The tree search (``CreativeWritingTask``) splits it in two prompts of its own,
one for the plan and one for the passage that follows a plan (ToT's single output holds both), and scores with
ToT's ``score_prompt`` wording, made to name a plan or a passage.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from spectot.data.jsonl import DataError, iter_lines
from spectot.tasks.base import Problem, State, StepRequest, Task

COT_PROMPT = (
    "Write a coherent passage of 4 short paragraphs. The end sentence of each paragraph must be: {input}\n\n"
    "Make a plan then write. Your output should be of the following format:\n\nPlan:\nYour plan here.\n\n"
    "Passage:\nYour passage here."
)

logger = logging.getLogger(__name__)


def read_inputs(path: str | Path, offset: int = 0, limit: int = 0, complete: bool = False) -> list[str]:
    """Lines ``offset + 1``, ``offset + 2``, ... (``limit`` non-blank ones, 0 = all) of a ToT text file;
    ``complete``: fewer than ``limit`` is a DataError (a benchmark asked for that many)."""
    picked = [line for _, line in read_numbered_inputs(path, offset, limit)]
    if complete and len(picked) < limit:
        raise DataError(f"{path} has {len(picked)} input(s) after line {offset}, the run asks for {limit}")
    return picked


def read_numbered_inputs(path: str | Path, offset: int = 0, limit: int = 0) -> list[tuple[int, str]]:
    """(physical line number, line) of the non-blank lines after the first ``offset`` lines; each must
    hold the four sentences of a ToT input (DataError naming file:line otherwise)."""
    picked = []
    for number, line in iter_lines(path):
        if number <= offset or not line.strip():
            continue
        _check_sentences(path, number, line)
        picked.append((number, line))
        if limit and len(picked) == limit:
            break
    return picked


# An unterminated sentence runs into the next one: "...bachelorette party You realize...". The ToT
# file itself has four such lines (6, 29, 50 and 60); required_sentences splits them there.
_RUN_ON = re.compile(r"[a-z] (?!I\b)[A-Z]")
_STRAIGHT_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def _check_sentences(path: str | Path, number: int, line: str) -> None:
    """Refuse a line that is not a ToT input: graded against the wrong sentences, it would score silently."""
    sentences = required_sentences(line)
    if len(sentences) != 4:
        raise DataError(
            f"{path}:{number}: expected the 4 sentences of a Creative Writing input (each ending in . ! or ?), "
            f"found {len(sentences)}"
        )
    if len(_terminated_sentences(line)) == 3:
        logger.warning(
            "%s:%d: one sentence is unterminated; the line was split at the run-on, into %s",
            path,
            number,
            " | ".join(sentences),
        )


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
    last_proposals = None  # a plan and a passage of paragraphs: no one-line proposals
    depth = 2

    def __init__(self, plan_tokens: int = 160, passage_tokens: int = 480, score_tokens: int = 384) -> None:
        self.plan_tokens, self.passage_tokens, self.score_tokens = plan_tokens, passage_tokens, score_tokens

    def thought(self, problem: Problem, state: State) -> StepRequest:
        sentences = problem.question + "\n"
        if not state:
            return StepRequest(PLAN_PROMPT.format(input=sentences), (), self.plan_tokens)
        return StepRequest(PASSAGE_PROMPT.format(input=sentences, plan=state[0]), (), self.passage_tokens)

    def parse_thought(self, problem: Problem, state: State, text: str) -> str:
        return text.strip()

    def value(self, problem: Problem, state: State) -> StepRequest:
        """The analysis the prompt asks for comes before its conclusion: 96 tokens cut 7 of 8 SmolLM2 analyses
        before it, so the request allows ``score_tokens``."""
        what = "plan" if len(state) == 1 else "passage"
        return StepRequest(SCORE_PROMPT.format(what=what, text=state[-1]), (), self.score_tokens)

    def parse_value(self, text: str) -> float:
        """The concluded "coherency score is s" (the last), clipped to 1-10; without one the lowest score, as
        ToT ignores an output that does not conclude (any digit of the analysis, "4 paragraphs", is no score)."""
        plain = re.sub(r"[*_]", "", text)  # markdown emphasis: "is: **8**"
        match = re.findall(r"coherency score is\D{0,3}(\d+)", plain, flags=re.IGNORECASE)
        return float(min(10, max(1, int(match[-1])))) if match else 1.0

    def is_final(self, problem: Problem, state: State) -> bool:
        return len(state) >= self.depth

    def final_answer(self, problem: Problem, state: State) -> str:
        return state[-1] if len(state) >= self.depth else ""

    def grade(self, problem: Problem, answer: str) -> float:
        return paragraph_endings(answer, problem.answer)


def required_sentences(line: str) -> list[str]:
    """The four sentences of an input line: split after ., ! or ? followed by a space and, when that
    gives 3, also at the first run-on, where an unterminated sentence meets the next capital:
    "A. Instead of a party You realize. B." -> "A.", "Instead of a party", "You realize.", "B."."""
    sentences = _terminated_sentences(line)
    run_on = _RUN_ON.search(line) if len(sentences) == 3 else None
    if run_on is None:
        return sentences
    cut = run_on.start() + 1
    return _terminated_sentences(line[:cut]) + _terminated_sentences(line[cut:])


def _terminated_sentences(line: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", line.strip()) if s.strip()]


def paragraph_endings(passage: str, sentences: list[str]) -> float:
    """Share of required sentences that end a paragraph, in order (sentence i ends paragraph i).

    Sentences are matched to paragraphs as an in-order subsequence, so a title line or a closing
    "The End" before or after the four paragraphs shifts nothing, while paragraphs out of order
    still lose points. Paragraphs are split at blank lines, or at single newlines when blank lines
    give fewer paragraphs than there are sentences (one paragraph per line).
    """
    if not sentences:
        return 0.0
    paragraphs = _paragraphs(passage, len(sentences))
    best = [0] * (len(paragraphs) + 1)  # best[j]: most sentences so far matched in order in paragraphs[:j]
    for sentence in sentences:
        row = [0]
        for j, paragraph in enumerate(paragraphs):
            row.append(max(row[j], best[j + 1], best[j] + _ends_with(paragraph, sentence)))
        best = row
    return best[-1] / len(sentences)


def _paragraphs(passage: str, wanted: int) -> list[str]:
    blocks = [p.strip() for p in re.split(r"\n\s*\n", passage.strip()) if p.strip()]
    return blocks if len(blocks) >= wanted else [line.strip() for line in passage.splitlines() if line.strip()]


def _ends_with(paragraph: str, sentence: str) -> bool:
    """Whether the paragraph ends with the sentence as whole words ("A. Bit was hot." does not end
    with "It was hot."), up to case, spacing, markdown emphasis and curly quotes; a sentence left
    unterminated in the input ("The heat") may gain a final . ! or ?."""
    target = _norm(sentence)
    terminator = "" if target.endswith((".", "!", "?")) else "[.!?]?"
    return re.search(rf"(?<!\w){re.escape(target)}{terminator}$", _norm(paragraph)) is not None


def _norm(text: str) -> str:
    """Lowercase words separated by single spaces, * _ # (markdown emphasis) dropped, quotes straight."""
    return " ".join(re.sub(r"[*_#]", "", text.translate(_STRAIGHT_QUOTES)).split()).lower()


def load_problems(path: str | Path, limit: int = 0, offset: int = 0) -> list[Problem]:
    """One problem per non-blank input line, its id ``line-N`` from its physical line number N."""
    lines = read_numbered_inputs(path, offset, limit)
    return [Problem(f"line-{number}", line, required_sentences(line)) for number, line in lines]
