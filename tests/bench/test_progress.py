"""The progress bar long jobs share: a job that fails before any unit is done leaves no empty bar behind."""

from __future__ import annotations

import pytest

from spectot.bench.progress import progress_bar


def test_a_job_that_fails_at_startup_leaves_no_empty_bar(capsys) -> None:
    with pytest.raises(RuntimeError, match="cannot reach"), progress_bar() as bar:
        bar.add_task("gsm8k / rebase", total=None)
        raise RuntimeError("cannot reach the server")
    assert "gsm8k / rebase" not in capsys.readouterr().out


def test_a_job_that_did_some_work_keeps_its_bar(capsys) -> None:
    with pytest.raises(RuntimeError, match="problem 2"), progress_bar() as bar:
        task = bar.add_task("gsm8k / rebase", total=3)
        bar.update(task, completed=1)
        raise RuntimeError("problem 2 failed")
    assert "gsm8k / rebase" in capsys.readouterr().out  # how far it got
    with progress_bar() as bar:
        bar.add_task("gsm8k / plain", total=None)
    assert "gsm8k / plain" in capsys.readouterr().out
