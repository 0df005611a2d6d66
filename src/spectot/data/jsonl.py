"""Reading JSONL files strictly: a line that does not parse is named, never skipped silently."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A data file that cannot be read as promised; the message names the file and line."""


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for each non-blank line; raise DataError on a malformed one."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
            yield number, obj


def read_field(path: str | Path, field: str, limit: int = 0) -> list[str]:
    """The string ``field`` of each line (the first ``limit`` lines if limit > 0)."""
    values = []
    for number, obj in iter_jsonl(path):
        if field not in obj or not isinstance(obj[field], str):
            raise DataError(f"{path}:{number}: no string field '{field}' (fields: {', '.join(obj) or 'none'})")
        values.append(obj[field])
        if limit and len(values) == limit:
            break
    return values
