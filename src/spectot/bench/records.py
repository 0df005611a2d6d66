"""Benchmark records: one JSON line per finished measurement, keyed by the run's configuration,
so an interrupted benchmark resumes where it stopped and a changed configuration starts afresh."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch


def machine_info() -> dict:
    """Where a benchmark ran: the host, torch, its CPU threads and the CUDA GPU if torch sees one."""
    info = {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


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
