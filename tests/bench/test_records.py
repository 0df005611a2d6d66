"""Benchmark records: a torn last line is measured again, a broken line is named, records of another
configuration (flags, the content of the files they name, the machine) are not reused."""

from __future__ import annotations

import logging

import pytest

from spectot.bench.records import append_record, content_id, load_records, run_identity
from spectot.data.jsonl import DataError


def test_records_resume_and_a_torn_last_line_is_measured_again(tmp_path, caplog) -> None:
    path, config = tmp_path / "records.jsonl", {"target": "m", "n": 2}
    records: dict = {}
    append_record(path, config, ("a", 0), {"seconds": 1.0}, records)
    append_record(path, config, ("a", 1), {"seconds": 2.0}, records)
    assert load_records(path, config) == {("a", 0): {"seconds": 1.0}, ("a", 1): {"seconds": 2.0}}
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # killed while appending the second record
    with caplog.at_level(logging.WARNING):
        assert load_records(path, config) == {("a", 0): {"seconds": 1.0}}
    assert "cut short" in caplog.text
    records = load_records(path, config)
    append_record(path, config, ("a", 1), {"seconds": 3.0}, records)  # the rerun appends on a clean line
    assert load_records(path, config) == {("a", 0): {"seconds": 1.0}, ("a", 1): {"seconds": 3.0}}


def test_a_broken_line_inside_is_named(tmp_path) -> None:
    path, config = tmp_path / "records.jsonl", {"n": 1}
    append_record(path, config, ("a",), {}, {})
    path.write_text(path.read_text() + "{oops\n" + path.read_text())
    with pytest.raises(DataError, match=r"records.jsonl:2: not a JSON line"):
        load_records(path, config)
    other = tmp_path / "other.jsonl"  # --out at a folder whose file is something else: refused, not cut short
    other.write_bytes(b'oops\n{"a": 1}')
    with pytest.raises(DataError, match=r"other.jsonl:1: not a JSON line"):
        load_records(other, config)
    assert other.read_bytes() == b'oops\n{"a": 1}'


def test_records_of_another_configuration_are_left_and_counted(tmp_path, caplog) -> None:
    path = tmp_path / "records.jsonl"
    append_record(path, {"n": 1}, ("a",), {"x": 1}, {})
    path.write_text(path.read_text() + '{"config": {"n": 2}, "method": "old format"}\n')
    with caplog.at_level(logging.WARNING):
        assert load_records(path, {"n": 2}) == {}
    assert "2 record(s) of another configuration" in caplog.text


def test_the_identity_follows_the_content_of_the_files_named(tmp_path) -> None:
    data, draft = tmp_path / "q.jsonl", tmp_path / "draft"
    data.write_text('{"question": "1 + 1"}\n')
    draft.mkdir()
    (draft / "draft.safetensors").write_bytes(b"weights")
    options = {"data": str(data), "draft": str(draft), "target": "smollm2-135m", "note": ""}
    first = run_identity(options)
    assert set(first["inputs"]) == {"data", "draft"}  # an alias and an empty string name no file
    assert first["machine"]["threads"] >= 1
    assert run_identity(options) == first
    (draft / "draft.safetensors").write_bytes(b"retrained")  # same folder, new weights: another run
    second = run_identity(options)
    assert second["inputs"]["draft"] != first["inputs"]["draft"]
    assert second["inputs"]["data"] == first["inputs"]["data"] == content_id(data)


def test_the_identity_also_covers_ablation_drafts_the_code_and_the_cpu(tmp_path, monkeypatch) -> None:
    """An --ablation tuple's draft folders were never hashed, spectot's version (0.1.0 throughout) stood for its
    code and shipped drafts, and 'platform' named the OS, not the CPU: stale records of another draft, engine or
    machine were reused."""
    import spectot.bench.records as records

    draft = tmp_path / "edd-ce"
    draft.mkdir()
    (draft / "draft.safetensors").write_bytes(b"weights")
    options = {"ablation": (f"ce={draft},num_draft_tokens=4", "hidden=edd")}
    first = run_identity(options)
    assert list(first["inputs"]) == [f"ablation:{draft}"]
    assert first["machine"]["cpu"] and first["code"] == records.code_id()
    (draft / "draft.safetensors").write_bytes(b"retrained")
    assert run_identity(options)["inputs"] != first["inputs"]
    monkeypatch.setattr(records, "code_id", lambda: "another build")
    assert run_identity(options)["code"] == "another build"


def test_the_code_id_ignores_compiled_files(tmp_path, monkeypatch) -> None:
    """``__pycache__`` fills in as modules are first imported: counted, a run resumed after importing one more
    module would not match its own records."""
    import spectot.bench.records as records

    before = records.code_id()
    cache = records.Path(records.__file__).resolve().parents[1] / "__pycache__" / "spectot_test_probe.pyc"
    cache.parent.mkdir(exist_ok=True)
    try:
        cache.write_bytes(b"compiled")
        assert records.code_id() == before
    finally:
        cache.unlink()
