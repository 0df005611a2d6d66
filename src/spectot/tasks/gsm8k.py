"""GSM8K as a Tree-of-Thoughts task, in the form SEED uses (Wang et al. 2024, COLING 2025, appendix C).

SEED decomposes a word problem into sub-questions: one prompt asks for the next sub-question, one
for its sub-answer, and an evaluator rates a step with "a number between 1 and 10". Here a *step*
(one generation, one tree edge) is a sub-question together with its sub-answer, written in one go:

    Step 1: Question: How many cookies did she sell? Answer: 15 + 9 = 24. The answer is 24.

so a BFS of depth 4 takes three such steps and a fourth that answers the problem itself
("Now we can answer the question: ... The answer is N."). Generating the pair at once halves the
number of G calls against SEED's two-prompt split and gives the evaluator a complete step to judge.
The prompts are our own text in the spirit of SEED's and of RAP's GSM8K sub-question prompts
(llm-reasoners), with two worked demonstrations written for this module (not from GSM8K). They are
plain instructions that a small chat model (SmolLM2-135M-Instruct) receives as its user message.

Answers are number strings in canonical form ("18", "-3", "0.5"): commas, "$" and trailing zeros
after a decimal point removed, and graded exactly as written (1000001 is not 1000000). The step
helpers (``clean_step``, ``render_steps``) and the 1-10 rating (``rating_request``, ``parse_rating``)
are shared with the MATH-500 task.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

from spectot.data.jsonl import DataError, iter_jsonl
from spectot.tasks.base import Problem, State, StepRequest, Task

FINAL_MARKER = "Now we can answer the question"

DEMONSTRATIONS = """\
Problem: A baker made 50 cookies. She sold 15 in the morning and 9 in the afternoon, then baked 20 more. \
How many cookies does she have now?
Step 1: Question: How many cookies did she sell in total? Answer: She sold 15 + 9 = 24 cookies. The answer is 24.
Step 2: Question: How many cookies were left after selling? Answer: 50 - 24 = 26 cookies were left. \
The answer is 26.
Step 3: Question: How many cookies are there after she bakes more? Answer: 26 + 20 = 46 cookies. The answer is 46.
Step 4: Now we can answer the question: She has 46 cookies now. The answer is 46.

Problem: Tom buys 3 notebooks for $4 each and a pen for $2. He pays with a $20 bill. How much change does he get?
Step 1: Question: How much do the notebooks cost? Answer: 3 * 4 = $12. The answer is 12.
Step 2: Question: How much does he spend in total? Answer: 12 + 2 = $14. The answer is 14.
Step 3: Question: How much is left from $20? Answer: 20 - 14 = $6. The answer is 6.
Step 4: Now we can answer the question: Tom gets $6 in change. The answer is 6."""

THOUGHT_PROMPT = (
    "Solve the math word problem by breaking it into sub-questions. Each step asks one sub-question and "
    'answers it, ending with "The answer is N." The last step starts with "{marker}:".\n\n'
    "{demos}\n\nProblem: {question}\n{steps}\n{instruction}"
)
NEXT_STEP = 'Write Step {k} only, as "Step {k}: Question: ... Answer: ... The answer is N."'
LAST_STEP = 'Write Step {k} only, as "Step {k}: {marker}: ... The answer is N."'

# The steps come last but one and in the order they were written, so a state's prompt extends its
# parent's (the prefix cache holds the parent's KV): only the new step and the closing line are prefilled.
VALUE_PROMPT = (
    "Rate the latest step of a solution to a {kind} with a number between 1 and 10: "
    "10 if the step is correct and useful for solving the problem, 1 if it is wrong or useless.\n\n"
    "Problem: {question}\n{steps}\n"
    "Rate Step {k}, the latest step. Reply with the number only.\nRating:"
)

# A number as written in text: "1,234.5", "1\u00a0234" (a no-break or thin space between thousands), "-3", "−3"
# (U+2212), "$18", "$ 18", ".5", "3/4". A minus is a sign only where it cannot be a subtraction: it must touch the
# number, so the numbers of "16-3" and of "50 - 24" are 16, 3 and 50, 24, never -3 or -24. A group of thousands
# is whole: "1,2345" is no 1234.
NUMBER = (
    r"(?<![\w.])[-\u2212]?\d+/\d+(?![\d/])"
    r"|(?<![\w.])[-\u2212]?(?:\$\s?)?(?:\d{1,3}(?:[,\u00a0\u202f]\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"|(?<![\w.])[-\u2212]?\$?\.\d+"
)
OPERATION = re.compile(r"\s*[-+*/×÷x\u2212]\s*\$?\.?\d")  # after a number: "4 * 6" is an expression, not a result
ANSWER_IS = re.compile(r"answer is\b", re.IGNORECASE)
HASHES = re.compile(r"####")
BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
STEP_LABEL = re.compile(r"^\s*\**\s*step\s*\d+\s*[:.]?\s*\**\s*[:.]?\s*", re.IGNORECASE)
STEP_BREAK = re.compile(r"\n\s*\n|\n\s*(?:\*\*)?step\s*\d", re.IGNORECASE)


# -- data ------------------------------------------------------------------------------------------
def load_problems(path: str | Path, limit: int = 0) -> list[Problem]:
    """The problems of a GSM8K JSONL file (the first ``limit`` if limit > 0); id = line number."""
    problems = []
    for number, obj in iter_jsonl(path):
        for key in ("question", "answer"):
            if not isinstance(obj.get(key), str):
                raise DataError(
                    f"{path}:{number}: no string field '{key}' (fields: {', '.join(obj) or 'none'}); "
                    "a GSM8K line needs 'question' and 'answer'"
                )
        gold = gold_answer(obj["answer"])
        if gold is None:
            raise DataError(f"{path}:{number}: the answer does not end in '#### <number>'; is this a GSM8K file?")
        problems.append(Problem(str(number), obj["question"], gold, {"solution": obj["answer"]}))
        if limit and len(problems) == limit:
            break
    return problems


def gold_answer(solution: str) -> str | None:
    """The number after the last '####' of a GSM8K reference solution, in canonical form."""
    if "####" not in solution:
        return None
    tail = solution.rsplit("####", 1)[1].strip()
    return canonical_number(tail) if re.fullmatch(NUMBER, tail) else None


# -- answers ---------------------------------------------------------------------------------------
def canonical_number(text: str) -> str:
    """'$1,234.50' -> '1234.5', '18.0' -> '18', '-.5' -> '-0.5', '6/8' -> '3/4', '6/3' -> '2' (text must match
    NUMBER)."""
    text = re.sub(r"[$,\s\u00a0\u202f]", "", text).replace("\u2212", "-")
    if "/" in text:
        numerator, denominator = (int(part) for part in text.split("/"))
        if denominator == 0:
            return text
        value = Fraction(numerator, denominator)
        return str(value.numerator) if value.denominator == 1 else str(value)
    sign = "-" if text.startswith("-") else ""
    digits = text.lstrip("-")
    whole, _, fraction = digits.partition(".")
    whole = whole.lstrip("0") or "0"
    fraction = fraction.rstrip("0")
    value = f"{whole}.{fraction}" if fraction else whole
    return "0" if value == "0" else sign + value


def extract_number(text: str) -> str | None:
    """The final answer number of a model output, or None when it states no number.

    The last explicit answer statement wins: "The answer is X" (X is read from the rest of its
    sentence, see _stated_number), "#### X" or \\boxed{X}, whichever comes last; else the last number
    anywhere. X may carry "$", thousands commas, a sign and a decimal part.
    """
    statements = [(m.end(), text[m.end() :].split("\n", 1)[0]) for m in ANSWER_IS.finditer(text)]
    statements += [(m.end(), text[m.end() :].split("\n", 1)[0]) for m in HASHES.finditer(text)]
    statements += [(m.end(), m.group(1)) for m in BOXED.finditer(text)]
    for _, stated in sorted(statements, reverse=True):
        number = _stated_number(stated)
        if number is not None:
            return number
    numbers = re.findall(NUMBER, text)
    return canonical_number(numbers[-1]) if numbers else None


def _stated_number(statement: str) -> str | None:
    """The number an answer statement gives: the first after the last '=' when its sentence works it
    out ("5 + 3 = 8." -> 8, "3 * 4 = 12" -> 12) and no expression follows it ("24 = 4 * 6" -> 24), else the
    first in the sentence ("5. Then 6" -> 5); a step's number is none ("in step 3: 42" -> 42)."""
    sentence = re.split(r"[.!?](?:\s|$)", statement, maxsplit=1)[0]
    sentence = re.sub(r"\bstep\s*\d+", " ", sentence, flags=re.IGNORECASE)
    result = re.search(NUMBER, sentence.rsplit("=", 1)[-1])
    worked_out = result is not None and not OPERATION.match(result.string, result.end())
    match = result if worked_out else re.search(NUMBER, sentence)
    return canonical_number(match.group(0)) if match else None


def numbers_equal(a: str, b: str) -> bool:
    """Whether two number strings name exactly the same value: '18.00' equals '18', but '1000001' is
    not '1000000' (a relative tolerance of 1e-6 would accept it)."""
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return False


RATING_OUT_OF = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/|out of)\s*10\b", re.IGNORECASE)
# "scale of 1 to 10", "from 1-10", "between 1 and 10", "a 1-10 scale": the prompt's range, restated
RATING_SCALE = re.compile(
    r"\b(?:(?:scale\s+of|from|between)\s+)?[01]\s*(?:-|–|to|and)\s*10\b(?:\s*scale)?", re.IGNORECASE
)


# a closed $...$ span with no words in it is math ("$3 + 4 = 7$", "$5 \times 3$", "$2.5$"); one with words
# ("$14 total is right, $") joins two amounts of money
MATH_SPAN = re.compile(r"\$([^$\n]*)\$")
WORD = re.compile(r"(?<![\\{a-zA-Z])[a-zA-Z]{3,}")
# "$14", "$ 1,200.50": money (GSM8K's); "$3x" is math
MONEY = re.compile(r"\$\s?\d[\d,]*+(?:\.\d+)?+(?![\w^{\\])")
# a step's number ("Step 2: 9", "Step 3 is wrong"), unless it is the last thing said ("I rate this step 8.")
STEP_NUMBER = re.compile(r"\bstep\s*\d++(?![\s.!,;]*$)", re.IGNORECASE)


def parse_rating(text: str, low: float = 1.0, high: float = 10.0) -> float:
    """An evaluator's rating, clipped to [low, high]; ``low`` when it gives none: an explicit "N/10" or "N out
    of 10", else the first number that is neither inside $...$ math ("$3 + 4 = 7$ is right: 8" rates 8; cut off,
    "The value of $3x + " rates nothing), money ("The $14 total is right: 9" rates 9), a step's ("Step 2: 9" rates
    9; "Step 3 is wrong." nothing; "I rate this step 8." 8) nor a scale's bound ("On a scale of 1 to 10, 8" rates
    8)."""
    explicit = RATING_OUT_OF.search(text)
    if explicit is not None:
        return min(high, max(low, float(explicit.group(1))))
    plain = MATH_SPAN.sub(lambda m: m.group(0) if WORD.search(m.group(1)) else " ", text)
    plain = MONEY.sub(" ", plain)
    plain = re.sub(r"\$[^$]*$", " ", plain)  # math cut off
    plain = STEP_NUMBER.sub(" ", plain)
    plain = RATING_SCALE.sub(" ", plain)
    match = re.search(r"(?<![\w.])-?\d+(?:\.\d+)?", plain)
    if match is None:
        return low
    return min(high, max(low, float(match.group(0))))


def clean_step(text: str) -> str:
    """One step from raw output: cut at the next step or blank line, drop a "Step k:" label, one line."""
    text = STEP_BREAK.split(text.strip(), maxsplit=1)[0]
    text = STEP_LABEL.sub("", text)
    return " ".join(text.split())


def render_steps(state: State) -> str:
    return "".join(f"Step {i}: {step}\n" for i, step in enumerate(state, start=1))


def rating_request(question: str, state: State, kind: str = "math word problem") -> StepRequest:
    """The evaluator's prompt: rate the last step of ``state`` 1-10, given the problem and earlier steps."""
    if not state:
        raise ValueError("value() needs a state with at least one step; evaluate states after expanding them")
    prompt = VALUE_PROMPT.format(kind=kind, question=question, steps=render_steps(state), k=len(state))
    return StepRequest(prompt, ("\n",), 8)


# -- the task --------------------------------------------------------------------------------------
class Gsm8kTask(Task):
    """ToT BFS over sub-question steps; ``depth - 1`` sub-questions, then the final answer."""

    name = "gsm8k"
    last_proposals = f'These are the last steps: each starts with "{FINAL_MARKER}:" and ends with "The answer is N."'

    def __init__(self, depth: int = 4, max_step_tokens: int = 96) -> None:
        if depth < 2:
            raise ValueError(f"--depth {depth}: GSM8K's search needs >= 2 steps (a sub-question, then the answer)")
        self.depth = depth
        self.max_step_tokens = max_step_tokens

    def thought(self, problem: Problem, state: State) -> StepRequest:
        k = len(state) + 1
        last = len(state) >= self.depth - 1
        instruction = (LAST_STEP if last else NEXT_STEP).format(k=k, marker=FINAL_MARKER)
        prompt = THOUGHT_PROMPT.format(
            marker=FINAL_MARKER,
            demos=DEMONSTRATIONS,
            question=problem.question,
            steps=render_steps(state),
            instruction=instruction,
        )
        return StepRequest(prompt, ("\nStep", "\n\n"), self.max_step_tokens)

    def parse_thought(self, problem: Problem, state: State, text: str) -> str:
        return clean_step(text)

    def value(self, problem: Problem, state: State) -> StepRequest:
        return rating_request(problem.question, state)

    def parse_value(self, text: str) -> float:
        return parse_rating(text)

    def is_final(self, problem: Problem, state: State) -> bool:
        return len(state) >= self.depth or bool(state and FINAL_MARKER.lower() in state[-1].lower())

    def final_answer(self, problem: Problem, state: State) -> str:
        """A finished state's answer is its last step's number ("" if it states none: an earlier step's is a
        sub-answer, not the answer); an open one's (a search's fallback) the latest number of its steps."""
        steps = state[-1:] if self.is_final(problem, state) else reversed(state)
        for step in steps:
            number = extract_number(step)
            if number is not None:
                return number
        return ""

    def grade(self, problem: Problem, answer: str) -> float:
        return 1.0 if answer and numbers_equal(answer, str(problem.answer)) else 0.0

    def same_answer(self, a: str, b: str) -> bool:
        return numbers_equal(a, b)
