"""GSM8K task: loading the real files, answer extraction, prompts and rating parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from spectot.data.jsonl import DataError
from spectot.tasks.base import Problem
from spectot.tasks.gsm8k import (
    Gsm8kTask,
    canonical_number,
    extract_number,
    load_problems,
    numbers_equal,
    parse_rating,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
needs_data = pytest.mark.skipif(not (DATA / "test.jsonl").exists(), reason=f"GSM8K data not found under {DATA}")


@needs_data
def test_loads_the_real_test_file() -> None:
    problems = load_problems(DATA / "test.jsonl")
    assert len(problems) == 1100
    first = problems[0]
    assert first.id == "1" and first.answer == "18"
    assert first.question.startswith("Janet")
    assert first.meta["solution"].endswith("#### 18")
    assert [p.id for p in load_problems(DATA / "test.jsonl", limit=3)] == ["1", "2", "3"]


@needs_data
@pytest.mark.parametrize("split", ["test", "train"])
def test_every_gold_answer_is_a_canonical_number(split: str) -> None:
    problems = load_problems(DATA / f"{split}.jsonl")
    for problem in problems:
        tail = problem.meta["solution"].rsplit("####", 1)[1]
        assert float(problem.answer) == float(tail.replace(",", "")), problem.id
        assert extract_number(problem.meta["solution"]) == problem.answer, problem.id
    assert any("," in p.meta["solution"].rsplit("####", 1)[1] for p in problems)  # commas really were removed


def test_malformed_line_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    good = '{"question": "q?", "answer": "so\\n#### 1,000"}'
    path.write_text("\n".join([good, good, '{"question": "q?"']) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"gsm\.jsonl:3: not valid JSON"):
        load_problems(path)
    assert [p.answer for p in load_problems(path, limit=2)] == ["1000", "1000"]


@pytest.mark.parametrize(
    ("line", "message"),
    [('{"question": "q?"}', r":2: no string field 'answer'"), ('{"question": "q?", "answer": "7"}', r":2: .*####")],
)
def test_incomplete_line_names_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "q?", "answer": "#### 1"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=message):
        load_problems(path)


@pytest.mark.parametrize(
    ("output", "number"),
    [
        ("The answer is 18.", "18"),
        ("She makes $18 every day.\n#### 18", "18"),
        ("So the total is \\boxed{1,234}.", "1234"),
        ("He has 5 apples and 3 pears, 8 in total.", "8"),
        ("The answer is $1,234.50.", "1234.5"),
        ("The temperature drops to -7 degrees. The answer is -7.", "-7"),
        ("It costs 18.0 dollars", "18"),
        ("16-3-4 = 9", "9"),
        ("The answer is: 72 dollars, since 8 * 9 = 72 and 3 more", "72"),
        ("The answer is 5. Then we add 6 more for fun.", "5"),
        ("Step 1 gives 4, the answer is 12. Later: the answer is 13", "13"),
        ("It takes .5 hours", "0.5"),
        ("#### 1,000,000", "1000000"),
        ("The answer is 5 + 3 = 8.", "8"),
        ("The answer is 3 * 4 = 12", "12"),
        ("The answer is 8 = x.", "8"),
        ("He had 50 - 24", "24"),
        ("It costs $ 18", "18"),
        ("The temperature is \u22125 degrees", "-5"),
        ("I don't know.", None),
        # review: a no-break / thin space between thousands, fractions, whole comma groups, an expression after
        # '=', a step's number
        ("The answer is $1\u00a0000.", "1000"),
        ("The answer is 12\u202f500 dollars.", "12500"),
        ("The answer is 3/4.", "3/4"),
        ("The answer is 6/3.", "2"),
        ("The answer is 1/2 + 1/4 = 3/4.", "3/4"),
        ("answer is 1,2345", "1"),
        ("The answer is 24 = 4 * 6.", "24"),
        ("The answer is in step 3: 42", "42"),
    ],
)
def test_extract_number(output: str, number: str | None) -> None:
    assert extract_number(output) == number


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("18", "18.00", True),
        ("0.5", ".50", True),
        ("1000000", "1000001", False),
        ("0.1", "0.1000001", False),
        ("3/4", "0.75", True),
        ("1/0", "1", False),
    ],
)
def test_numbers_equal_is_exact(a: str, b: str, equal: bool) -> None:
    assert numbers_equal(a, b) is equal and numbers_equal(b, a) is equal


def test_canonical_number() -> None:
    assert [canonical_number(s) for s in ("$1,234.50", "18.0", "-.5", "007", "-0", "3.140")] == [
        "1234.5",
        "18",
        "-0.5",
        "7",
        "0",
        "3.14",
    ]


def test_thought_prompt_holds_question_and_previous_steps() -> None:
    task, problem = Gsm8kTask(), Problem.make_dummy("Ann has 3 cats and 2 dogs. How many pets?", "5")
    first = task.thought(problem, ())
    assert problem.question in first.prompt and "Write Step 1 only" in first.prompt
    assert first.stop == ("\nStep", "\n\n") and first.max_new_tokens == 96
    state = ("Question: How many cats? Answer: 3. The answer is 3.", "Question: How many dogs? Answer: 2.")
    second = task.thought(problem, state)
    assert f"Step 1: {state[0]}\nStep 2: {state[1]}\n" in second.prompt
    assert "Write Step 3 only" in second.prompt and "Now we can answer" not in second.prompt.splitlines()[-1]
    last = task.thought(problem, (*state, "Question: Total? Answer: 5."))
    assert last.prompt.splitlines()[-1].startswith('Write Step 4 only, as "Step 4: Now we can answer the question:')


def test_value_prompt_marks_the_latest_step() -> None:
    task, problem = Gsm8kTask(), Problem.make_dummy()
    request = task.value(problem, ("first step", "second step"))
    assert problem.question in request.prompt
    assert "Step 1: first step\nStep 2: second step\n" in request.prompt and "Rate Step 2, the latest" in request.prompt
    # a child's prompt extends its parent's up to the parent's last step: the prefix cache reuses that KV
    parent = task.value(problem, ("first step",)).prompt
    assert request.prompt.startswith(parent[: parent.index("first step") + len("first step\n")])
    assert "between 1 and 10" in request.prompt and request.stop == ("\n",) and request.max_new_tokens == 8
    with pytest.raises(ValueError, match="at least one step"):
        task.value(problem, ())


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("8", 8.0),
        (" 7/10", 7.0),
        ("Rating: 10", 10.0),
        ("I'd give it a 6.5 out of 10", 6.5),
        ("0", 1.0),
        ("15", 10.0),
        ("-3", 1.0),
        ("great step!", 1.0),
        ("", 1.0),
        ("Step 2: 9", 9.0),  # the step's number is no rating
        ("I rate Step 3 a 7.", 7.0),
        ("The value of $3x + ", 1.0),  # math is no rating (a real SmolLM2 output on MATH)
        ("Correct, 3 + 4 = 7. Rating: 8/10", 8.0),
        ("On a scale of 1 to 10, 8", 8.0),  # the prompt's range restated is no rating
        ("On a 1-10 scale I give it 7", 7.0),
        ("Between 1 and 10: 9", 9.0),
        ("It adds 3 and 4 to get 7", 3.0),  # "3 and 4" names no range ending at 10
        ("15 - 10 = 5, rating 9", 10.0),  # nor arithmetic: only 0 or 1 to 10 is the scale
        # review: money read as math cut off (everything after it dropped), a rated step's number dropped
        (" The $14 total is right: 9", 9.0),
        ("It costs $ 1,200.50 in all, so 8", 8.0),
        ("$3x + 1$ is right, so I rate 8", 8.0),
        (" I would rate this step 8.", 8.0),
        (" This step 9", 9.0),
        ("Step 2 is correct. 9", 9.0),
        # review of the review: inline math that opens with a digit, a step named without a rating
        ("$3 + 4 = 7$ is correct. Rating: 8", 8.0),
        ("The cost is $5 \\times 3 = 15$. Score: 6", 6.0),
        ("The step computes $2.5$ per apple correctly. 7", 7.0),
        ("$2.5x$ is fine: 7", 7.0),
        ("The total is $14. Rating 8", 8.0),
        ("The $14 total is right, $5 each. 8", 8.0),
        ("Step 3 is wrong.", 1.0),
        ("Step 3 is correct because the", 1.0),
        ("Step 10 is fine, 6", 6.0),
    ],
)
def test_parse_value(text: str, score: float) -> None:
    assert Gsm8kTask().parse_value(text) == score == parse_rating(text)


def test_parse_thought_keeps_one_step() -> None:
    task, problem = Gsm8kTask(), Problem.make_dummy()
    raw = "Step 2: Question: How many?\nAnswer: 3 + 2 = 5. The answer is 5.\nStep 3: Question: more?"
    assert task.parse_thought(problem, (), raw) == "Question: How many? Answer: 3 + 2 = 5. The answer is 5."
    assert task.parse_thought(problem, (), "  **Step 1:** Question: A?\n\nnoise") == "Question: A?"


def test_final_state_answer_and_grade() -> None:
    task, problem = Gsm8kTask(), Problem.make_dummy("What is 2 + 3?", "5")
    early = ("Question: What is 2? Answer: 2. The answer is 2.",)
    assert not task.is_final(problem, early)
    done = (*early, "Now we can answer the question: 2 + 3 = 5. The answer is 5.")
    assert task.is_final(problem, done) and task.final_answer(problem, done) == "5"
    full = ("a", "b", "c", "no number in the last step")
    assert task.final_answer(problem, (*early, "nothing")) == "2"  # an open state: the latest number (a fallback)
    # a finished state answers with its last step: an earlier step's number is a sub-answer, voted and graded
    assert task.is_final(problem, full) and task.final_answer(problem, ("It is 24.", *full[1:])) == ""
    stated = (*early, "Now we can answer the question: she has forty-six cookies.")
    assert task.is_final(problem, stated) and task.final_answer(problem, stated) == ""
    assert task.final_answer(problem, ("nothing",)) == ""
    assert task.grade(problem, "5.0") == 1.0 and task.grade(problem, "6") == 0.0 and task.grade(problem, "") == 0.0
    with pytest.raises(ValueError, match="--depth 1: GSM8K.s search needs >= 2 steps"):
        Gsm8kTask(depth=1)
