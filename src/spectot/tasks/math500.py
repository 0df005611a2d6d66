"""MATH-500 (the PRM800K test split of Hendrycks MATH) as a step-by-step Tree-of-Thoughts task.

Owns the loader, the answer extraction (the last ``\\boxed{...}``), the answer normaliser and the
equivalence test used for grading. A step is one paragraph of a solution (stop at a blank line);
the ``depth``-th step must close the solution with ``\\boxed{answer}``. The evaluator rates the
latest step 1-10 as for GSM8K.

Grading follows the spirit of the Hendrycks MATH ``is_equiv`` and the PRM800K grader: answers are
normalised as strings first (``\\dfrac`` -> ``\\frac``, units and ``^\\circ`` dropped, ``x =`` prefixes
stripped, ...), then compared element-wise as tuples / intervals, then symbolically with sympy via a
small LaTeX -> sympy converter written here (``sympy.parsing.latex`` needs antlr, which we do not
require). sympy is imported lazily; without it only the string comparison runs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from spectot.data.jsonl import DataError, iter_jsonl
from spectot.tasks.base import Problem, State, StepRequest, Task
from spectot.tasks.gsm8k import clean_step, parse_rating, rating_request, render_steps

DEMONSTRATION = """\
Problem: What is the sum of the solutions of $x^2 - 5x + 6 = 0$?
Step 1: Factor the quadratic: $x^2 - 5x + 6 = (x - 2)(x - 3)$.
Step 2: Setting each factor to zero gives the solutions $x = 2$ and $x = 3$.
Step 3: Their sum is $2 + 3 = 5$.
Step 4: The answer is $\\boxed{5}$."""

THOUGHT_PROMPT = (
    "Solve the math problem step by step. Each step is one short paragraph. "
    "The last step gives the final answer as \\boxed{{answer}}.\n\n"
    "{demo}\n\nProblem: {question}\n{steps}\n{instruction}"
)
NEXT_STEP = "Write Step {k} only, as one short paragraph."
LAST_STEP = "Write Step {k} only: finish the solution and put the final answer in \\boxed{{}}."

UNIT_WORDS = (
    "degrees?|cm|centimeters?|meters?|km|kilometers?|inches|inch|feet|foot|ft|yards?|miles?|mph|"
    "units?|square|seconds?|minutes?|hours?|days?|weeks?|months?|years?|dollars?|cents?|points?|"
    "pounds?|ounces?|gallons?|liters?|people|students?|ways|times"
)
THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
FUNCTIONS = ("sqrt", "pi", "oo", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp")
SAFE_EXPRESSION = re.compile(r"[0-9A-Za-z+\-*/().,^ ]*")


# -- data ------------------------------------------------------------------------------------------
def load_problems(path: str | Path, limit: int = 0) -> list[Problem]:
    """The problems of a MATH JSONL file (the first ``limit`` if limit > 0); id = unique_id or line."""
    problems = []
    for number, obj in iter_jsonl(path):
        for key in ("problem", "answer"):
            if not isinstance(obj.get(key), str):
                raise DataError(
                    f"{path}:{number}: no string field '{key}' (fields: {', '.join(obj) or 'none'}); "
                    "a MATH line needs 'problem' and 'answer'"
                )
        meta = {key: obj[key] for key in ("solution", "subject", "level") if key in obj}
        meta["line"] = number
        problem_id = str(obj.get("unique_id") or number)
        problems.append(Problem(problem_id, obj["problem"], obj["answer"], meta))
        if limit and len(problems) == limit:
            break
    return problems


# -- extraction ------------------------------------------------------------------------------------
def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} / \\fbox{...} (braces balanced), else "The answer is X"."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start >= 0:
        rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
        if rest.startswith("{"):
            inner = _braced(rest, 0)
            if inner is not None:
                return inner[0].strip()
        elif rest.startswith(" "):  # "\boxed 5$"
            token = re.match(r"\s+([^\s$]+)", rest)
            if token:
                return token.group(1)
    found = list(re.finditer(r"answer is:?", text, flags=re.IGNORECASE))
    if not found:
        return None
    tail = text[found[-1].end() :].split("\n", 1)[0].strip()
    tail = re.sub(r"\.$", "", tail).strip().strip("$").strip()
    return tail or None


def _braced(text: str, open_at: int) -> tuple[str, int] | None:
    """The content of the brace group opening at ``open_at`` and the index after it; None if unbalanced."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i], i + 1
    return None


# -- normalisation ---------------------------------------------------------------------------------
def normalize_answer(answer: str) -> str:
    """A canonical string for a MATH answer, so that equal answers written differently compare equal."""
    s = answer.strip()
    boxed = extract_boxed(s) if s.startswith(("\\boxed", "\\fbox")) else None
    s = boxed if boxed is not None else s
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    for spacing in ("\\,", "\\;", "\\:", "\\quad", "\\qquad", "~", "\\displaystyle"):
        s = s.replace(spacing, " ")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\circ", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(rf"(\d|\}})\s*(?:{UNIT_WORDS})(?:\^?\{{?[23]\}}?)?\s*\.?\s*$", r"\1", s)
    s = re.sub(r"^\s*[a-zA-Z]\s*\\in\s*", "", s)
    s = re.sub(r"\s*\.\s*$", "", s).strip()
    s = _strip_short_lhs(s)
    s = _fix_sqrt(_fix_fracs(s))
    s = s.replace(" ", "")
    if THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    s = _fix_a_slash_b(s)
    s = re.sub(r"^\(([A-Ea-e])\)$", r"\1", s)
    return s


def _strip_short_lhs(s: str) -> str:
    """'x = 3' -> '3' (a one- or two-character left side, as the Hendrycks grader does)."""
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2 and parts[0].strip():
        return parts[1].strip()
    return s


def _fix_fracs(s: str) -> str:
    """'\\frac12' -> '\\frac{1}{2}', '\\frac1{b}' -> '\\frac{1}{b}'."""
    return re.sub(r"\\frac\s*(\{[^{}]*\}|\w)\s*(\{[^{}]*\}|\w)", lambda m: f"\\frac{_brace(m[1])}{_brace(m[2])}", s)


def _fix_sqrt(s: str) -> str:
    """'\\sqrt3' -> '\\sqrt{3}'."""
    return re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)


def _brace(group: str) -> str:
    return group if group.startswith("{") else "{" + group + "}"


def _fix_a_slash_b(s: str) -> str:
    """'3/4' -> '\\frac{3}{4}' for a plain integer ratio."""
    match = re.fullmatch(r"(-?)(\d+)/(\d+)", s)
    return f"{match[1]}\\frac{{{match[2]}}}{{{match[3]}}}" if match else s


# -- equivalence -----------------------------------------------------------------------------------
def is_equiv(pred: str | None, gold: str) -> bool:
    """Whether a predicted answer equals the gold one: same normal form, element-wise or symbolically."""
    if pred is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a == b:
        return True
    if not a or not b:
        return False
    parts_a, parts_b = _split_sequence(a), _split_sequence(b)
    if parts_a is not None or parts_b is not None:
        return _sequences_equal(parts_a or ("", [a], ""), parts_b or ("", [b], ""))
    return _symbolically_equal(a, b)


def _split_sequence(s: str) -> tuple[str, list[str], str] | None:
    """'(1,2]' -> ('(', ['1', '2'], ']'); '1,2' -> ('', ['1', '2'], ''); None when there is no top-level comma."""
    opening, closing = "", ""
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}" and _top_level_split(s[1:-1]) is not None:
        opening, closing, s = s[0], s[-1], s[1:-1]
    parts = _top_level_split(s)
    return None if parts is None else (opening, parts, closing)


def _top_level_split(s: str) -> list[str] | None:
    """``s`` split at commas outside brackets; None if it has no such comma or unbalanced brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts if len(parts) > 1 and depth == 0 else None


def _sequences_equal(a: tuple[str, list[str], str], b: tuple[str, list[str], str]) -> bool:
    """Bracketed sequences match in order with equal brackets; bare lists ("1,-2") in any order."""
    (open_a, items_a, close_a), (open_b, items_b, close_b) = a, b
    if (open_a, close_a) != (open_b, close_b) or len(items_a) != len(items_b):
        return False
    if open_a:
        return all(is_equiv(x, y) for x, y in zip(items_a, items_b))
    remaining = list(items_b)
    for x in items_a:
        match = next((y for y in remaining if is_equiv(x, y)), None)
        if match is None:
            return False
        remaining.remove(match)
    return True


def _symbolically_equal(a: str, b: str) -> bool:
    """Equality of two normalised answers as sympy expressions; False when either does not parse."""
    x, y = latex_to_sympy(a), latex_to_sympy(b)
    if x is None or y is None:
        return False
    try:
        if x == y:
            return True
        return _close_everywhere(x, y)
    except (TypeError, ValueError, ArithmeticError):
        return False


def _close_everywhere(x: Any, y: Any) -> bool:
    """x == y numerically (relative 1e-6), at three fixed points when they have free symbols.

    ``evalf(subs=...)`` evaluates in floating point, so 10^{10^{10}} cannot stall an exact computation.
    """
    import sympy

    symbols = sorted(x.free_symbols | y.free_symbols, key=str)
    points = [{s: sympy.Rational(3 + 2 * i + j, 7 + i) for j, s in enumerate(symbols)} for i in range(3)]
    for point in points[: 3 if symbols else 1]:
        u, v = complex(x.evalf(subs=point)), complex(y.evalf(subs=point))
        if not all(map(math.isfinite, (u.real, u.imag, v.real, v.imag))):
            return False
        if abs(u - v) > max(1e-9, 1e-6 * max(abs(u), abs(v))):
            return False
    return True


def latex_to_sympy(s: str) -> Any | None:
    """A sympy expression for a small LaTeX subset (numbers, letters, + - * / ^, \\frac, \\sqrt, \\pi,
    \\cdot, \\times, \\infty, trig/log names, mixed numbers like 1\\frac{4}{5}); None otherwise or when
    sympy is not installed."""
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:
        return None
    text = _latex_to_python(s)
    if text is None or len(text) > 200:
        return None
    names: dict[str, Any] = {ch: sympy.Symbol(ch) for ch in "abcdefghjklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names.update(i=sympy.I, pi=sympy.pi, oo=sympy.oo, ln=sympy.log)
    transformations = (*standard_transformations, implicit_multiplication_application, convert_xor)
    try:
        return parse_expr(text, local_dict=names, transformations=transformations, evaluate=False)
    except Exception:  # noqa: BLE001 - sympy's parser raises anything from SyntaxError to TypeError
        return None


def _latex_to_python(s: str) -> str | None:
    """The LaTeX subset as a Python-syntax expression for sympy, or None if it uses anything else."""
    mixed = re.fullmatch(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}", s)
    if mixed:
        sign, whole, num, den = mixed.groups()
        return f"{sign}({whole}+{num}/{den})"
    s = _replace_command_groups(s)
    if s is None:
        return None
    for latex, python in (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", " pi "), ("\\infty", " oo ")):
        s = s.replace(latex, python)
    for name in FUNCTIONS:
        s = s.replace("\\" + name, " " + name + " ")
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if "\\" in s or not SAFE_EXPRESSION.fullmatch(s) or "," in s:
        return None
    return re.sub(r"[A-Za-z]+", _split_name, s)


def _replace_command_groups(s: str) -> str | None:
    """\\frac{a}{b} -> ((a)/(b)), \\sqrt{x} -> sqrt(x), \\sqrt[n]{x} -> ((x)**(1/(n))), ^{e} -> **(e);
    innermost groups first (an argument with braces inside matches only once those are replaced)."""
    pattern = re.compile(
        r"\\frac\{([^{}]*)\}\{([^{}]*)\}|\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}|\\sqrt\{([^{}]*)\}|\^\{([^{}]*)\}"
    )
    for _ in range(32):
        match = pattern.search(s)
        if match is None:
            return s
        num, den, root, radicand, sqrt_arg, exponent = match.groups()
        if num is not None:
            replacement = f"(({num})/({den}))"
        elif root is not None:
            replacement = f"(({radicand})**(1/({root})))"
        elif sqrt_arg is not None:
            replacement = f" sqrt({sqrt_arg})"
        else:
            replacement = f"**({exponent})"
        s = s[: match.start()] + replacement + s[match.end() :]
    return None


def _split_name(match: re.Match[str]) -> str:
    """Known function names stay; any other run of letters is a product of one-letter symbols."""
    word = match.group(0)
    return word if word in FUNCTIONS else "*".join(word)


# -- the task --------------------------------------------------------------------------------------
class Math500Task(Task):
    """ToT BFS over solution paragraphs; the ``depth``-th step gives \\boxed{answer}."""

    name = "math500"

    def __init__(self, depth: int = 4, max_step_tokens: int = 160) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: use depth >= 1 (the last step gives the boxed answer)")
        self.depth = depth
        self.max_step_tokens = max_step_tokens

    def thought(self, problem: Problem, state: State) -> StepRequest:
        k = len(state) + 1
        instruction = (LAST_STEP if len(state) >= self.depth - 1 else NEXT_STEP).format(k=k)
        prompt = THOUGHT_PROMPT.format(
            demo=DEMONSTRATION, question=problem.question, steps=render_steps(state), instruction=instruction
        )
        return StepRequest(prompt, ("\n\n", "\nStep"), self.max_step_tokens)

    def parse_thought(self, problem: Problem, state: State, text: str) -> str:
        return clean_step(text)

    def value(self, problem: Problem, state: State) -> StepRequest:
        return rating_request(problem.question, state, kind="math problem")

    def parse_value(self, text: str) -> float:
        return parse_rating(text)

    def is_final(self, problem: Problem, state: State) -> bool:
        return len(state) >= self.depth or bool(state and ("\\boxed" in state[-1] or "\\fbox" in state[-1]))

    def final_answer(self, problem: Problem, state: State) -> str:
        for step in reversed(state):
            if "\\boxed" in step or "\\fbox" in step:
                return extract_boxed(step) or ""
        return (extract_boxed(state[-1]) or "") if state else ""

    def grade(self, problem: Problem, answer: str) -> float:
        return 1.0 if answer and is_equiv(answer, str(problem.answer)) else 0.0

    def same_answer(self, a: str, b: str) -> bool:
        return is_equiv(a, b)
