"""MATH-500 (the PRM800K test split of Hendrycks MATH) as a step-by-step Tree-of-Thoughts task.

Owns the loader, the answer extraction (the last ``\\boxed{...}``), the answer normaliser and the
equivalence test used for grading. A step is one paragraph of a solution (stop at a blank line);
the ``depth``-th step must close the solution with ``\\boxed{answer}``. The evaluator rates the
latest step 1-10 as for GSM8K.

Grading follows the spirit of the Hendrycks MATH ``is_equiv`` and the PRM800K grader: answers are
normalised as strings first (``\\dfrac`` -> ``\\frac``, units and ``^\\circ`` dropped, ``x =`` prefixes
stripped, ...), then compared element-wise as tuples / intervals, then exactly with sympy via a
small LaTeX -> sympy converter written here (``sympy.parsing.latex`` needs antlr, which we do not
require). As in PRM800K's ``grade_answer``, nothing is equal "up to a tolerance": decimals are read
as exact rationals (0.3333333 is not 1/3), two integer fractions must be written alike (4/8 is not
the answer 1/2), two equations must be one rearranged (L_a - R_a = +-(L_b - R_b)), and
any other pair must satisfy ``simplify(a - b) == 0``. A ``\\pm`` answer lists its two roots; sets (``\\{1,2\\}``)
and bare lists compare in any order. Words compare as strings, case-insensitively. sympy is imported lazily;
without it only the string comparison runs.
"""

from __future__ import annotations

import math
import re
import warnings
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

# A run of these after a number is a unit ("12 square feet"); a trailing \text{ ...} group that starts
# with a space is a unit whatever it says, as in Hendrycks' _remove_right_units ("5 \text{ m}").
UNIT_WORDS = (
    "degrees?|cm|centimeters?|meters?|km|kilometers?|inches|inch|feet|foot|ft|yards?|miles?|mph|"
    "units?|square|seconds?|minutes?|hours?|days?|weeks?|months?|years?|dollars?|cents?|points?|"
    "pounds?|ounces?|gallons?|liters?|people|students?|ways|times"
)
THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
FUNCTIONS = ("sqrt", "pi", "oo", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp")
SAFE_EXPRESSION = re.compile(r"[0-9A-Za-z+\-*/().,^ ]*")
TEXT_UNITS = re.compile(
    r"(?<=\S)\s*\\(?:text|textrm|mbox|mathrm)\s*\{\s[^{}]*\}\s*(?:\^\s*\{?\s*[23]\s*\}?)?\s*\.?\s*$"
)
WORD = re.compile(r"[A-Za-z]{2,}")
PLUS_MINUS = re.compile(r"\\(?:pm|mp)(?![A-Za-z])")
PM_MARK = "\x00"  # a \pm while an answer is normalised
# A matrix or vector: its environment, an optional column spec (array's {cc}), the rows.
MATRIX = re.compile(r"\\begin\{([pbvBV]?matrix|array)\}\s*(?:\{[lcr| ]*\})?(.*)\\end\{\1\}", re.DOTALL)
# The largest exponent sympy may meet, the exponents of nested powers multiplied ((2^{10})^{3} has 30):
# exact arithmetic and evalf on 9^{9^{9^{9}}} would not finish.
MAX_EXPONENT = 1000


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
    tails = [text[m.end() :].split("\n", 1)[0].strip() for m in reversed(found)]
    # the last statement that does not open with a plain word ("The answer is $\frac{14}{3}$. We can check that
    # this answer is correct." answers 14/3, not "correct"; "x = 5" and "\frac12" are answers); else the last one
    stated = next((tail for tail in tails if not re.match(r"[A-Za-z]{2,}\b", tail)), tails[0])
    return _stated_answer(stated)


def _stated_answer(tail: str) -> str | None:
    """The answer that opens ``tail``: its leading $...$ formula, else the text up to the sentence end.

    "$x = 5$. Another line" -> "x = 5"; "\\(x = 5\\)." -> "x = 5"; "3.5 meters. Then" -> "3.5 meters" (a decimal point
    is no end).
    """
    formula = re.match(r"\$+([^$]*)\$|\\\((.*?)\\\)|\\\[(.*?)\\\]", tail)  # $x$, \(x\) or \[x\]
    answer = (
        next(g for g in formula.groups() if g is not None)
        if formula
        else re.split(r"\.(?:\s|$)", tail, maxsplit=1)[0].strip("$")
    )
    return answer.strip() or None


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
    s = _unboxed(answer.strip())
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    for spacing in ("\\,", "\\;", "\\:", "\\quad", "\\qquad", "~", "\\displaystyle"):
        s = s.replace(spacing, " ")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\[()\[\]]", "", s)  # \( \) and \[ \]: math delimiters, as $
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\circ|\\degree\b", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = TEXT_UNITS.sub("", s)
    s = re.sub(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(rf"(\d|\}})(?:\s*(?:{UNIT_WORDS}))+(?:\^?\{{?[23]\}}?)?\s*\.?\s*$", r"\1", s)
    s = re.sub(r",?\s+(?:and|or)\s+", ",", s)  # "1 and -2", "x = 1 or x = 2" list the roots as "1,-2" does
    s = s.replace("{,}", ",").replace("\\{", "{").replace("\\}", "}")  # 58{,}500; the set \{1,2\} as {1,2}
    s = re.sub(r"_\{\s*(\w+)\s*\}", r"_\1", s)  # base subscripts: 52_{8} is 52_8
    s = re.sub(r"^\s*[a-zA-Z]\s*\\in\s*", "", s)
    s = re.sub(r"\s*\.\s*$", "", s).strip()
    s = _strip_short_lhs(s)
    s = _fix_sqrt(_fix_fracs(s))
    s = PLUS_MINUS.sub(PM_MARK, s)  # before the spaces go: "1 \pm i" must not read as "\pmi"
    s = s.replace(" ", "")
    if THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    s = _fix_a_slash_b(s)
    s = re.sub(r"^\(([A-Ea-e])\)$", r"\1", s)
    if PM_MARK in s:  # 1 \pm \sqrt{19}: the two roots, as "1+\sqrt{19},1-\sqrt{19}" lists them, item by item
        s = _expand_plus_minus(s)
    return s.lower() if WORD.fullmatch(s) else s  # "East" answers "east"; one letter keeps its case


def _expand_plus_minus(s: str) -> str:
    """Each top-level item with one \\pm becomes its two values ("0,\\pm2" -> "0,+2,-2"); an item of several keeps
    its \\pm (2^k combinations are no answer anyone writes)."""
    opening, items, closing = _split_sequence(s) or ("", [s], "")  # a set {0, \pm 1} keeps its braces
    out = []
    for item in items:
        if item.count(PM_MARK) == 1:
            out += [item.replace(PM_MARK, "+"), item.replace(PM_MARK, "-")]
        else:
            out.append(item.replace(PM_MARK, "\\pm"))
    return opening + ",".join(out) + closing


def _unboxed(s: str) -> str:
    """The content of a leading \\boxed{...} / \\fbox{...}, else ``s``."""
    boxed = extract_boxed(s) if s.startswith(("\\boxed", "\\fbox")) else None
    return boxed if boxed is not None else s


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
    """'\\sqrt3' -> '\\sqrt{3}', '\\sqrt13' -> '\\sqrt{13}' (the whole number, as the common MATH graders read it;
    one digit made 3\\sqrt13 = 3 sqrt(1) 3 = 9), '\\sqrt2x' -> '\\sqrt{2}x' (a number's digits only: the whole word
    made it sqrt(2x)), '\\sqrtx' -> '\\sqrt{x}'."""
    return re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"\\sqrt{\1}", s)


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
    matrix_a, matrix_b = matrix_entries(pred), matrix_entries(gold)
    if matrix_a is not None or matrix_b is not None:
        return _matrices_equal(matrix_a, matrix_b)
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a == b:
        return True
    if not a or not b:
        return False
    parts_a, parts_b = _split_sequence(a), _split_sequence(b)
    if parts_a is not None or parts_b is not None:
        return _sequences_equal(parts_a or ("", [a], ""), parts_b or ("", [b], ""))
    return _symbolically_equal(a, b)


def same_value(a: str, b: str) -> bool:
    """``is_equiv`` for grouping votes: integer fractions compared by value, so \\frac{6}{4}, \\frac{3}{2} and 1.5
    are one answer. (Grading keeps PRM800K's rule that they be written alike; voting by it split one value's
    weight, and in an order-dependent way, since 1.5 equals both fractions while they differ.)"""
    return is_equiv(_reduced_fractions(a), _reduced_fractions(b))


def _reduced_fractions(answer: str) -> str:
    """Every integer fraction in lowest terms: '\\frac{6}{4}', '\\dfrac64' and '6/4' -> '\\frac{3}{2}',
    '\\frac{4}{2}' -> '2'."""
    answer = _fix_fracs(re.sub(r"\\[dt]frac", r"\\frac", answer))
    answer = re.sub(r"(?<![\w}.^_])(-?\d+)\s*/\s*(-?\d+)(?![\w{.^])", r"\\frac{\1}{\2}", answer)

    def reduce(match: re.Match) -> str:
        num, den = int(match[1]), int(match[2])
        if den == 0:
            return match[0]
        g = math.gcd(num, den) * (-1 if den < 0 else 1)
        num, den = num // g, den // g
        return str(num) if den == 1 else f"\\frac{{{num}}}{{{den}}}"

    return re.sub(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}", reduce, answer)


def matrix_entries(answer: str) -> list[list[str]] | None:
    """The rows of entries of a matrix answer ('\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}' -> [['1', '0'],
    ['0', '1']]), whatever its environment (pmatrix, bmatrix, array with a column spec, inside \\left( \\right));
    None when the answer is not one matrix."""
    s = _unboxed(answer.strip().strip("$").strip()).replace("\\left", "").replace("\\right", "").strip()
    s = s[1:-1].strip() if s[:1] + s[-1:] in ("()", "[]") else s
    match = MATRIX.fullmatch(s)
    if match is None:
        return None
    rows = [row for row in re.split(r"\\\\(?:\[[^\]]*\])?", match[2]) if row.strip()]
    return [[entry.strip() for entry in row.split("&")] for row in rows]


def _matrices_equal(a: list[list[str]] | None, b: list[list[str]] | None) -> bool:
    """Same shape and every entry equivalent; a matrix never equals a non-matrix."""
    if a is None or b is None or [len(row) for row in a] != [len(row) for row in b]:
        return False
    return all(is_equiv(x, y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


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
    """Bracketed sequences match in order with equal brackets; bare lists ("1,-2") and sets ({1,2}) in any order, a
    set and a bare list alike (the roots \\{3,5,7\\} answer "3, 5, 7")."""
    (open_a, items_a, close_a), (open_b, items_b, close_b) = (
        ("", items, "") if (opening, closing) == ("{", "}") else (opening, items, closing)
        for opening, items, closing in (a, b)
    )
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
    """Exact equality of two different normalised answers; False when either does not parse.

    Words are not products of letters ("seat" is not "east"), and two integer fractions must be
    written alike, as PRM800K grades: an unreduced \\frac{4}{8} does not answer \\frac{1}{2}.
    """
    if _is_word(a) or _is_word(b):
        return False
    fractions = _integer_fraction(a), _integer_fraction(b)
    if None not in fractions:
        return fractions[0] == fractions[1]
    if a.count("=") == 1 and b.count("=") == 1:
        return _equations_equal(a, b)
    x, y = latex_to_sympy(a), latex_to_sympy(b)
    return x is not None and y is not None and _expressions_equal(x, y)


def _expressions_equal(x: Any, y: Any) -> bool:
    """x == y exactly: numerically first (cheap, and most unequal pairs fail it), then ``simplify``; an expression
    sympy cannot evaluate is no answer."""
    try:
        return x == y or (_close_everywhere(x, y) and _difference_is_zero(x, y))
    except (TypeError, ValueError, ArithmeticError):
        return False


def _equations_equal(a: str, b: str) -> bool:
    """Two equations L_a = R_a and L_b = R_b that are one equation rearranged: L_a - R_a = +-(L_b - R_b).
    5x - 7y + 11z = -4 answers 5x - 7y + 11z + 4 = 0, and so does -5x + 7y - 11z - 4 = 0; a multiple
    (10x - 14y + 22z + 8 = 0) does not, as an unreduced fraction does not (the problem asks for a form)."""
    sides = [latex_to_sympy(side) for side in (*a.split("="), *b.split("="))]
    if any(side is None for side in sides):
        return False
    left, right = sides[0] - sides[1], sides[2] - sides[3]
    return _expressions_equal(left, right) or _expressions_equal(left, -right)


def _is_word(s: str) -> bool:
    return WORD.fullmatch(s) is not None and s not in FUNCTIONS


def _integer_fraction(s: str) -> tuple[int, int] | None:
    """(numerator, denominator) as written, the sign on the numerator: '-\\frac{4}{8}' -> (-4, 8)."""
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if match is None:
        return None
    sign, num, den = -1 if match[1] else 1, int(match[2]), int(match[3])
    return (sign * num, den) if den >= 0 else (-sign * num, -den)


def _difference_is_zero(x: Any, y: Any) -> bool:
    """PRM800K's test: simplify(x - y) == 0, exact (decimals were read as rationals).

    The parse is unevaluated; ``doit`` evaluates it first, which settles numbers at once (simplify
    alone takes seconds on \\sqrt{2}^{1000} - 2^{500}).
    """
    import sympy

    difference = (x - y).doit()
    return difference == 0 or sympy.simplify(difference) == 0


def _close_everywhere(x: Any, y: Any) -> bool:
    """x == y numerically (relative 1e-6), at three fixed points when they have free symbols.

    A cheap necessary condition: most wrong answers fail it, so ``simplify`` runs only on the
    likely equal pairs. latex_to_sympy refused huge powers, so evalf finishes. The values stay
    sympy (mpmath) floats, whose exponents have no bound: 2^{1100} is compared, not an overflow.
    """
    import sympy

    symbols = sorted(x.free_symbols | y.free_symbols, key=str)
    points = [{s: sympy.Rational(3 + 2 * i + j, 7 + i) for j, s in enumerate(symbols)} for i in range(3)]
    for point in points[: 3 if symbols else 1]:
        u, v = x.evalf(30, subs=point), y.evalf(30, subs=point)
        if not (u.is_number and v.is_number and u.is_finite and v.is_finite):
            return False
        if abs(u - v) > max(1e-9, 1e-6 * max(abs(u), abs(v))):
            return False
    return True


def latex_to_sympy(s: str) -> Any | None:
    """A sympy expression for a small LaTeX subset (numbers, letters, + - * / ^, \\frac, \\sqrt, \\pi,
    \\cdot, \\times, \\infty, trig/log names, mixed numbers like 1\\frac{4}{5}); None otherwise, when
    a power is too large to compute with (see _powers_are_small) or when sympy is not installed.
    Decimals become exact rationals: 0.3333333 is 3333333/10^7, not 1/3."""
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            convert_xor,
            implicit_multiplication_application,
            parse_expr,
            rationalize,
            standard_transformations,
        )
    except ImportError:
        return None
    text = _latex_to_python(s)
    if text is None or len(text) > 200:
        return None
    names: dict[str, Any] = {ch: sympy.Symbol(ch) for ch in "abcdefghjklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names.update(i=sympy.I, pi=sympy.pi, oo=sympy.oo, ln=sympy.log)
    transformations = (*standard_transformations, implicit_multiplication_application, convert_xor, rationalize)
    try:
        with warnings.catch_warnings():  # malformed input ('\\frac{}{}') builds Pow(Tuple): deprecated, refused below
            warnings.simplefilter("ignore", sympy.utilities.exceptions.SymPyDeprecationWarning)
            expr = parse_expr(text, local_dict=names, transformations=transformations, evaluate=False)
    except Exception:  # noqa: BLE001 - sympy's parser raises anything from SyntaxError to TypeError
        return None
    # one expression only: '()' parses to a Python tuple, '\\frac{}{}' or 'f()' to a sympy Tuple inside one
    if not isinstance(expr, sympy.Expr) or expr.has(sympy.Tuple):
        return None
    return expr if _powers_are_small(expr) else None


def _powers_are_small(expr: Any, scale: float = 1.0) -> bool:
    """Whether every power (and exp) in ``expr`` is small enough to compute with exactly.

    A power's exponent must itself pass this test, and the size of its value times the sizes of the
    exponents enclosing the power must stay <= MAX_EXPONENT. So 2^{2^{3}} (size 8) and (2^{10})^{3}
    (10 * 3 = 30) pass, while 10^{1001} fails, and so does 9^{9^{9^{9}}}: the exponent of its
    exponent, 9^{9} = 387420489, is too large. Checked on the unevaluated parse, before anything is
    computed.
    """
    import sympy

    if isinstance(expr, sympy.exp):
        base, exponent = sympy.E, expr.args[0]
    elif expr.is_Pow:
        base, exponent = expr.base, expr.exp
    else:
        return all(_powers_are_small(arg, scale) for arg in expr.args)
    if not _powers_are_small(exponent):
        return False
    size = _exponent_size(exponent)
    return size is not None and scale * size <= MAX_EXPONENT and _powers_are_small(base, scale * size)


def _exponent_size(exponent: Any) -> float | None:
    """max(1, |exponent|) with each free symbol at 2, about the size of the grading points; None when
    it has no finite value. Only called on exponents whose own powers are small, so evalf finishes."""
    try:
        size = abs(complex(exponent.evalf(subs=dict.fromkeys(exponent.free_symbols, 2))))
    except (TypeError, ValueError, ArithmeticError):
        return None
    return max(size, 1.0) if math.isfinite(size) else None


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
    last_proposals = "These are the last steps: each finishes the solution and puts the final answer in \\boxed{}."

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
        return same_value(a, b)
