"""Creative Writing inputs: one problem per physical line of four sentences, named by its line number;
a BOM, a non-UTF-8 byte or a line that is not a ToT input is handled or named, never graded silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from spectot.data.jsonl import DataError
from spectot.tasks.creative_writing import load_problems, paragraph_endings, read_inputs

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
    assert sum(len(p.answer) == 4 for p in problems) == 76
    assert [r.args[1] for r in caplog.records] == [6, 29, 50, 60]  # their unterminated fragments, warned
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
