"""Strict JSONL reading: every malformed or incomplete line is named by its line number."""

from __future__ import annotations

from pathlib import Path

import pytest

from spectot.data.jsonl import DataError, iter_jsonl, read_field, resume_outputs


def write(tmp_path: Path, *lines: str, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_the_field_of_every_line(tmp_path) -> None:
    path = write(tmp_path, '{"question": "a?", "answer": "1"}', '{"question": "b?"}', '{"question": "c\\u00e9?"}')
    assert read_field(path, "question") == ["a?", "b?", "cé?"]
    assert read_field(str(path), "answer", limit=1) == ["1"]


def test_blank_lines_are_skipped_but_counted(tmp_path) -> None:
    path = write(tmp_path, '{"q": "a"}', "", "   ", '{"q": "b"}', "{oops")
    with pytest.raises(DataError, match=r"data\.jsonl:5: not valid JSON"):
        read_field(path, "q")
    assert read_field(path, "q", limit=2) == ["a", "b"]
    clean = write(tmp_path, '{"q": "a"}', "", '{"q": "b"}', name="clean.jsonl")
    assert list(iter_jsonl(clean)) == [(1, {"q": "a"}), (3, {"q": "b"})]


def test_malformed_line_is_named(tmp_path) -> None:
    path = write(tmp_path, '{"q": "a"}', '{"q": "b"}', '{"q": "c"')
    with pytest.raises(DataError) as err:
        read_field(path, "q")
    assert f"{path}:3:" in str(err.value)
    assert "not valid JSON" in str(err.value)


def test_a_line_nested_too_deep_is_named(tmp_path) -> None:
    path = write(tmp_path, '{"q": "a"}', "[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match=r"data\.jsonl:2: JSON nested too deep"):
        read_field(path, "q")


def test_a_torn_setup_file_is_named(tmp_path) -> None:
    from spectot.data.jsonl import results_file

    records, append = results_file(tmp_path / "r.jsonl", {"seed": 1}, resume=False)
    append({"id": "a"})
    (tmp_path / "r.jsonl.run.json").write_text('{"se')
    with pytest.raises(DataError, match=r"r\.jsonl\.run\.json: not the setup this job writes"):
        results_file(tmp_path / "r.jsonl", {"seed": 1}, resume=True)
    assert (tmp_path / "r.jsonl").read_text() == '{"id": "a"}\n'  # nothing lost
    (tmp_path / "r.jsonl.run.json").write_text('["seed", 1]')  # JSON, but no setup (an AttributeError before)
    with pytest.raises(DataError, match=r"r\.jsonl\.run\.json: not the setup this job writes \(a JSON list\)"):
        results_file(tmp_path / "r.jsonl", {"seed": 1}, resume=True)


def test_a_resume_with_nothing_to_resume_says_it_starts_afresh(tmp_path, caplog) -> None:
    """--resume into a file no earlier run wrote started every problem again without a word (a mistyped --json
    looked like a resumed run)."""
    from spectot.data.jsonl import results_file

    with caplog.at_level("WARNING", logger="spectot.data.jsonl"):
        assert results_file(tmp_path / "r.jsonl", {"seed": 1}, resume=True)[0] == []
    assert "r.jsonl holds no records of an earlier run; every problem runs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="spectot.data.jsonl"):  # the run after the CLI's early check: said once
        results_file(tmp_path / "r.jsonl", {"seed": 1}, resume=True)
    assert caplog.text == ""
    with caplog.at_level("WARNING", logger="spectot.data.jsonl"):
        results_file(tmp_path / "s.jsonl", {"seed": 1}, resume=False)
    assert caplog.text == ""


def test_a_benchmark_refuses_a_file_short_of_what_it_asks_for(tmp_path) -> None:
    """bench trees / drafts / generate read up to N questions and ran on fewer, labelled as N."""
    from spectot.tasks.creative_writing import read_inputs
    from spectot.tasks.registry import load_problems

    path = write(tmp_path, '{"question": "a", "answer": "#### 1"}', '{"question": "b", "answer": "#### 2"}')
    assert read_field(path, "question", 5) == ["a", "b"]  # a run of the lines there are, where that is asked
    with pytest.raises(DataError, match=r"data\.jsonl has 2 line\(s\), the run asks for 5"):
        read_field(path, "question", 5, complete=True)
    with pytest.raises(DataError, match=r"2 problem\(s\), the run asks for 3"):
        load_problems("gsm8k", str(path), 3, complete=True)
    cw = tmp_path / "cw.txt"
    cw.write_text("One. Two. Three. Four.\n")
    with pytest.raises(DataError, match=r"cw\.txt has 1 input\(s\) after line 0, the run asks for 2"):
        read_inputs(cw, 0, 2, complete=True)


def test_line_that_is_not_an_object_is_named(tmp_path) -> None:
    path = write(tmp_path, '{"q": "a"}', '["q", "b"]')
    with pytest.raises(DataError, match=r":2: expected a JSON object, got list"):
        read_field(path, "q")


def test_missing_field_names_the_line_and_the_fields_present(tmp_path) -> None:
    path = write(tmp_path, '{"q": "a"}', '{"question": "b", "id": 2}')
    with pytest.raises(DataError) as err:
        read_field(path, "q")
    message = str(err.value)
    assert f"{path}:2:" in message
    assert "'q'" in message
    assert "question, id" in message


def test_non_string_field_is_refused(tmp_path) -> None:
    path = write(tmp_path, '{"q": 7}')
    with pytest.raises(DataError, match=r":1: no string field 'q'"):
        read_field(path, "q")


def test_limit_stops_before_later_bad_lines(tmp_path) -> None:
    path = write(tmp_path, '{"q": "a"}', '{"q": "b"}', '{"q": "c"}', "not json")
    assert read_field(path, "q", limit=2) == ["a", "b"]
    assert read_field(path, "q", limit=3) == ["a", "b", "c"]
    with pytest.raises(DataError, match=":4:"):
        read_field(path, "q", limit=0)  # 0 = every line


def test_missing_file(tmp_path) -> None:
    with pytest.raises(DataError, match="no such file"):
        read_field(tmp_path / "absent.jsonl", "q")


def test_line_that_is_not_utf8_is_named(tmp_path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"q": "a"}\n{"q": "b"}\n{"q": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:3: not UTF-8 \(byte 0xe9"):
        read_field(path, "q")
    assert read_field(path, "q", limit=2) == ["a", "b"]


def test_byte_order_mark_before_the_first_line_is_accepted(tmp_path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes('{"q": "a"}\r\n{"q": "b"}\r\n'.encode("utf-8-sig"))
    assert list(iter_jsonl(path)) == [(1, {"q": "a"}), (2, {"q": "b"})]


def test_directory_is_named_as_one(tmp_path) -> None:
    with pytest.raises(DataError, match="is a directory, expected a file"):
        read_field(tmp_path, "q")


def test_resume_outputs_names_a_line_that_is_not_utf8(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"out\.jsonl:2: not an output line of this job"):
        resume_outputs(path, ["a", "b"])
    assert path.read_bytes() == b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n'  # nothing touched


def test_read_text_names_the_line_that_is_not_utf8(tmp_path) -> None:
    from spectot.data.jsonl import read_text

    path = tmp_path / "domain.pddl"
    path.write_bytes(b"\xef\xbb\xbf(define (domain blocks)\r\n  (:requirements :strips)\n caf\xe9)\n")
    with pytest.raises(DataError, match=r"domain.pddl:3: not UTF-8"):
        read_text(path)
    path.write_bytes(b"\xef\xbb\xbf(define\r\n x)\n")
    assert read_text(path) == "(define\n x)"
