"""Reading JSONL files strictly: a line that does not parse is named, never skipped silently."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A data file that cannot be read as promised; the message names the file and line."""


def decode_line(path: str | Path, number: int, raw: bytes) -> str:
    """Line ``number`` of ``path`` as text, its line ending removed. A BOM before line 1 is dropped
    (editors on Windows write one); bytes that are not UTF-8 are a DataError naming the line, since
    the bare UnicodeDecodeError names neither file nor line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}:{number}: not UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line); "
            "save the file as UTF-8"
        ) from None
    if number == 1:
        text = text.removeprefix("\ufeff")
    return text.rstrip("\r\n")


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, text) for every line of a UTF-8 text file; DataError when the file
    is absent, a directory, or has a line that is not UTF-8."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a file")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    with path.open("rb") as f:  # bytes: a decoding error then belongs to exactly one line
        for number, raw in enumerate(f, start=1):
            yield number, decode_line(path, number, raw)


def read_text(path: str | Path) -> str:
    """A whole UTF-8 text file (YAML, JSON, PDDL), with iter_lines' errors: a byte that is not UTF-8 is named by line."""
    return "\n".join(line for _, line in iter_lines(path))


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for each non-blank line; raise DataError on a malformed one."""
    for number, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
        except RecursionError:
            raise DataError(f"{path}:{number}: JSON nested too deep to read") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def read_field(path: str | Path, field: str, limit: int = 0, complete: bool = False) -> list[str]:
    """The string ``field`` of each line (the first ``limit`` lines if limit > 0); ``complete``: a file of fewer
    than ``limit`` lines is a DataError (a benchmark asked for that many), not a shorter run."""
    values = []
    for number, obj in iter_jsonl(path):
        if field not in obj or not isinstance(obj[field], str):
            raise DataError(f"{path}:{number}: no string field '{field}' (fields: {', '.join(obj) or 'none'})")
        values.append(obj[field])
        if limit and len(values) == limit:
            break
    if complete and len(values) < limit:
        raise DataError(f"{path} has {len(values)} line(s), the run asks for {limit}")
    return values


def appended_lines(path: Path) -> tuple[list[bytes], bytes]:
    """The whole lines of a file a job appends to, and its torn last line (b"" if none: a kill mid-append leaves
    one without its newline); ``drop_torn_line`` cuts that off so the rerun writes it again."""
    *lines, torn = path.read_bytes().split(b"\n")  # the last element is b"" after a final newline
    return lines, torn


def drop_torn_line(path: Path, torn: bytes) -> None:
    if torn:
        with path.open("r+b") as f:
            f.truncate(path.stat().st_size - len(torn))


def resume_outputs(path: str | Path, prompts: list[str]) -> int:
    """How many of ``prompts`` already have an output line in ``path`` (a JSONL file an earlier run of
    the same job appended to, one object with a "prompt" field per prompt, in order).

    A torn last line (the job was killed mid-write) is cut off so the rerun rewrites it; a line whose
    prompt is not the prompt at its position means the file belongs to another job: DataError, and
    nothing in the file is touched.
    """
    path = Path(path)
    if not path.exists():
        return 0
    complete, torn = appended_lines(path)
    for number, line in enumerate(complete, start=1):
        try:
            prompt = json.loads(line).get("prompt")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
            raise DataError(f"{path}:{number}: not an output line of this job; use another output file") from None
        if number > len(prompts) or prompt != prompts[number - 1]:
            raise DataError(
                f"{path}:{number}: holds the output of another prompt than prompt {number} of this job; "
                "use another output file (or the prompts that wrote it)"
            )
    drop_torn_line(path, torn)
    return len(complete)


def results_file(path: str | Path, setup: dict, resume: bool) -> tuple[list[dict], Callable[[dict], None]]:
    """The records an interrupted run of the same ``setup`` appended to ``path`` (with ``resume``; else the file
    starts empty), and an appender for the next ones.

    The setup is kept beside the records (``PATH.run.json``): a file written under another setup, or without
    one, is refused (its records would mix two runs); a line that is no record is named; a torn last line (the
    run was killed mid-write) is cut off, so its problem runs again."""
    out, kept = Path(path), Path(f"{path}.run.json")
    stored = json.loads(json.dumps(setup))  # as written: tuples come back as lists
    records: list[dict] = []
    if resume and out.exists() and out.stat().st_size:
        if not kept.exists():
            raise DataError(f"{path}: no {kept.name} beside it says which run wrote it; resume into another file")
        try:
            before = json.loads(kept.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{kept}: not the setup this job writes ({err}); resume into another file") from None
        if not isinstance(before, dict):
            raise DataError(
                f"{kept}: not the setup this job writes (a JSON {type(before).__name__}); resume into another file"
            )
        differ = sorted(k for k in stored.keys() | before.keys() if stored.get(k) != before.get(k))
        if differ:
            raise DataError(
                f"{path} holds the records of another setup ({', '.join(differ)} differ, see {kept}): resume with "
                "the same flags, or write to another file"
            )
        lines, torn = appended_lines(out)
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                record = None
            if not isinstance(record, dict) or "id" not in record:
                raise DataError(f"{path}:{number}: not a record of this job; resume into another file")
            records.append(record)
        drop_torn_line(out, torn)
    else:
        if resume and not out.exists():  # resuming whatever is there is a script's way to rerun a job: say it
            # starts afresh (once: a check before the model loads makes the file, empty)
            logger.warning("--resume: %s holds no records of an earlier run; every problem runs", path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("")
    partial = kept.with_name(kept.name + ".partial")  # a kill mid-write leaves the previous setup whole
    partial.write_text(json.dumps(stored, indent=1))
    partial.replace(kept)

    def append(record: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    return records, append
