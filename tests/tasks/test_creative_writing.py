"""Creative Writing inputs: one problem per physical line of four sentences, named by its line number;
a BOM, a non-UTF-8 byte or a line that is not a ToT input is handled or named, never graded silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from spectot.data.jsonl import DataError
from spectot.tasks.base import Problem
from spectot.tasks.creative_writing import (
    CreativeWritingTask,
    load_problems,
    paragraph_endings,
    read_inputs,
    required_sentences,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "tot_creative_writing" / "data_100_random_text.txt"
needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"Creative Writing data not found at {DATA}")

LINE_A = "The cat sat. A dog barked! Was it late? Night fell."
LINE_B = "One. Two. Three. Four."


def write(tmp_path: Path, text: str, encoding: str = "utf-8") -> Path:
    path = tmp_path / "inputs.txt"
    path.write_text(text, encoding=encoding)
    return path


@needs_data
def test_every_line_of_the_shared_file_loads(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        problems = load_problems(DATA)
    assert [p.id for p in problems] == [f"line-{n}" for n in range(1, 81)]
    assert all(len(p.answer) == 4 for p in problems)
    assert [r.args[1] for r in caplog.records] == [6, 29, 50, 60]  # their unterminated sentences, warned
    assert all("split at the run-on" in r.getMessage() for r in caplog.records)
    assert problems[28].answer[1:3] == [
        "The heat",
        "He picked up trash in his spare time to dump in his neighbor's yard.",
    ]
    passages = ["\n\n".join(f"Some text. {s}" for s in p.answer) for p in problems]
    assert [paragraph_endings(passage, p.answer) for passage, p in zip(passages, problems)] == [1.0] * 80
    assert [p.id for p in load_problems(DATA, limit=2, offset=10)] == ["line-11", "line-12"]


def test_ids_are_physical_line_numbers_across_blank_lines(tmp_path) -> None:
    path = write(tmp_path, f"{LINE_A}\n\n{LINE_B}\n   \n{LINE_A}")
    assert [p.id for p in load_problems(path)] == ["line-1", "line-3", "line-5"]
    assert [p.id for p in load_problems(path, offset=1, limit=1)] == ["line-3"]
    assert read_inputs(path, offset=2) == [LINE_B, LINE_A]


def test_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path) -> None:
    problem = load_problems(write(tmp_path, f"{LINE_A}\n", encoding="utf-8-sig"))[0]
    assert problem.answer[0] == "The cat sat."
    passage = "\n\n".join(f"Some text. {s}" for s in problem.answer)
    assert paragraph_endings(passage, problem.answer) == 1.0


def test_run_on_line_splits_into_four_sentences_a_passage_can_meet() -> None:
    line = "He was lazy. Instead of a party You realize you met Grandpa Joe. If I don\u2019t, I stay."
    sentences = required_sentences(line)
    assert sentences == [
        "He was lazy.",
        "Instead of a party",
        "You realize you met Grandpa Joe.",
        "If I don\u2019t, I stay.",
    ]
    passage = (
        "He was lazy.\n\nWe met instead of a party.\n\nThen You realize you met Grandpa Joe.\n\nIf I don't, I stay."
    )
    assert paragraph_endings(passage, sentences) == 1.0


SENTENCES = ["It was hot.", "The cat sat.", "Was it late?", "Night fell."]


@pytest.mark.parametrize(
    ("passage", "score"),
    [
        ("A. It was hot.\nB. The cat sat.\nC. Was it late?\nD. Night fell.", 1.0),  # one paragraph per line
        ("My Title\n\nA. It was hot.\n\nB. The cat sat.\n\nC. Was it late?\n\nD. Night fell.", 1.0),
        ("My Title\nA. It was hot.\nB. The cat sat.\nC. Was it late?\nD. Night fell.\nThe End", 1.0),
        ("*A. It was hot.*\n\n# B. The cat sat.\n\nC. _Was it late?_\n\n**D. Night fell.**", 1.0),  # markdown
        ("A. Bit was hot.\n\nB. The cat sat.\n\nC. Was it late?\n\nD. Night fell.", 0.75),  # "Bit" is not "It"
        ("B. The cat sat.\n\nA. It was hot.\n\nC. Was it late?\n\nD. Night fell.", 0.75),  # out of order
        ("A. It was hot. B. The cat sat. C. Was it late? D. Night fell.", 0.25),  # one paragraph
    ],
)
def test_paragraph_endings(passage: str, score: float) -> None:
    assert paragraph_endings(passage, SENTENCES) == score


def test_curly_quotes_match_straight_ones() -> None:
    assert paragraph_endings("So \u201cIt\u2019s hot,\u201d he said.", ['"It\'s hot," he said.']) == 1.0


def test_line_without_four_sentences_is_named(tmp_path) -> None:
    path = write(tmp_path, f"{LINE_A}\n\nOnly two sentences. Here.\n")
    with pytest.raises(DataError, match=r"inputs\.txt:3: expected the 4 sentences .* found 2"):
        load_problems(path)
    assert [p.id for p in load_problems(path, limit=1)] == ["line-1"]
    with pytest.raises(DataError, match=r":1: .* found 5"):
        load_problems(write(tmp_path, f"{LINE_B} Five.\n"))
    with pytest.raises(DataError, match=r":1: .* found 3"):
        load_problems(write(tmp_path, "One. Two. Three.\n"))  # no run-on fragment: really three


def test_line_that_is_not_utf8_is_named(tmp_path) -> None:
    path = tmp_path / "inputs.txt"
    path.write_bytes(LINE_A.encode() + b"\n" + b"Caf\xe9 one. Two. Three. Four.\n")
    with pytest.raises(DataError, match=r"inputs\.txt:2: not UTF-8 \(byte 0xe9"):
        read_inputs(path)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(DataError, match="no such file"):
        read_inputs(tmp_path / "absent.txt")


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("The passage flows well.\nThus the coherency score is 8", 8.0),
        ("Thus the coherency score is 3. On reflection, thus the coherency score is 6.", 6.0),
        ("The passage has 4 paragraphs and reads like 10*10 = 100 words", 1.0),  # no conclusion: the lowest
        ("Thus the coherency score is 14", 10.0),
        ("Thus the coherency score is: **8**", 8.0),  # markdown: '": **"' was past the 3 characters allowed
        ("Thus the __coherency score__ is 7.", 7.0),
    ],
)
def test_a_score_is_the_concluded_one(text: str, score: float) -> None:
    assert CreativeWritingTask().parse_value(text) == score


def test_the_score_request_leaves_room_for_the_analysis() -> None:
    task = CreativeWritingTask()
    assert task.value(Problem.make_dummy(), ("a plan",)).max_new_tokens == 384
