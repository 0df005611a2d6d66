"""How spectot's kernels get built: with one ninja whatever the entry point."""

from __future__ import annotations

import os
import shutil

import pytest

from spectot.engine.kernels import _package_ninja_first


def test_the_packages_ninja_builds_whatever_path_holds(monkeypatch) -> None:
    """torch's builder runs the first `ninja` on PATH; two ninja versions rebuilt each other's kernels (their logs
    disagree), so a build sees the `ninja` package's binary first, and PATH is as it was afterwards."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with _package_ninja_first():
        assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
        assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    assert os.environ["PATH"] == "/usr/bin:/bin"
    monkeypatch.delenv("PATH")
    with _package_ninja_first():
        assert os.environ["PATH"] == ninja.BIN_DIR
    assert "PATH" not in os.environ
