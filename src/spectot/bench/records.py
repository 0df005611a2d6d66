"""Benchmark records: one JSON line per finished measurement, keyed by the run's configuration,
so an interrupted benchmark resumes where it stopped and a changed configuration starts afresh."""

from __future__ import annotations

import json
from pathlib import Path


def load_records(path: Path, config_key: dict) -> dict[tuple, dict]:
    records = {}
    stored = json.loads(json.dumps(config_key))  # as written: tuples come back as lists
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["config"] == stored:
                records[tuple(rec["key"])] = rec["value"]
    return records


def append_record(path: Path, config_key: dict, key: tuple, value: dict, records: dict[tuple, dict]) -> None:
    if key in records:
        return
    records[key] = value
    with path.open("a") as f:
        f.write(json.dumps({"config": config_key, "key": list(key), "value": value}) + "\n")
