"""The kernel build folder's lock and name: a killed build cannot hang later runs, and two torch installs (or two
checkouts' kernel sources) keep their own builds. Nothing here compiles a kernel."""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

import pytest

from spectot.engine.kernels import _built, _exclusive_build, _torch_build_key

fcntl = pytest.importorskip("fcntl")


def test_a_stale_torch_lock_is_removed_under_our_lock(tmp_path: Path, caplog) -> None:
    """torch's ``lock`` file left by a killed build made every later build wait forever; holding our flock, it can
    only be stale, so it goes (with a warning) and the build goes on."""
    (tmp_path / "lock").write_text("")
    with caplog.at_level(logging.WARNING, logger="spectot.engine.kernels"), _exclusive_build(tmp_path, "noise"):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / ".spectot-build.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while the build runs
    assert "interrupted build of the noise kernel" in caplog.text
    with open(tmp_path / ".spectot-build.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released afterwards


def _take_lock(build: str, trying, taken) -> None:
    trying.set()  # imports done: only the lock stands between this process and ``taken``
    with _exclusive_build(Path(build), "noise"):
        taken.set()


def test_a_second_builder_waits_for_the_first(tmp_path: Path) -> None:
    """Another process takes the folder only once the first lets go."""
    context = multiprocessing.get_context("spawn")
    trying, taken = context.Event(), context.Event()
    with _exclusive_build(tmp_path, "noise"):
        other = context.Process(target=_take_lock, args=(str(tmp_path), trying, taken))
        other.start()
        assert trying.wait(timeout=120.0)
        assert not taken.wait(timeout=2.0)
    assert taken.wait(timeout=30.0)
    other.join(timeout=30.0)
    assert other.exitcode == 0


def test_the_build_folder_names_the_torch_version_and_path() -> None:
    """Readable version, then 8 hex digits of the install path: two venvs with one torch version differ."""
    first = _torch_build_key("2.13.0+cpu", Path("/envs/a/lib/python3.11/site-packages/torch"))
    second = _torch_build_key("2.13.0+cpu", Path("/envs/b/lib/python3.11/site-packages/torch"))
    assert first.startswith("2.13.0_cpu-") and len(first) == len("2.13.0_cpu-") + 8
    assert set(first.rsplit("-", 1)[1]) <= set("0123456789abcdef")
    assert first != second
    assert first == _torch_build_key("2.13.0+cpu", Path("/envs/a/lib/python3.11/site-packages/torch"))


def test_a_build_is_announced_only_when_its_folder_lacks_the_module(tmp_path: Path) -> None:
    assert not _built(tmp_path, "spectot_noise")
    (tmp_path / "spectot_noise.so").write_text("")
    assert _built(tmp_path, "spectot_noise")


def test_new_sources_build_in_a_folder_of_their_own(tmp_path: Path, monkeypatch) -> None:
    """ninja rebuilt on timestamps only: a new source older than the cached build (an archive, cp -p, a checkout)
    kept the old module loaded; and two checkouts with different sources sharing $SPECTOT_HOME rebuilt each other's
    kernels whenever they alternated. The build folder is named by the sources' digest."""
    import spectot.engine.kernels as kernels

    (tmp_path / "a.cpp").write_text("int f() { return 1; }")
    (tmp_path / "v.h").write_text("#define X 1")
    (tmp_path / "notes.txt").write_text("not a source")
    before = kernels._sources_digest(tmp_path)
    stamp = (tmp_path / "a.cpp").stat().st_mtime
    (tmp_path / "a.cpp").write_text("int f() { return 2; }")
    os.utime(tmp_path / "a.cpp", (stamp, stamp))
    kernels._sources_digest.cache_clear()
    after = kernels._sources_digest(tmp_path)
    assert after != before
    (tmp_path / "notes.txt").write_text("edited")  # not a source
    kernels._sources_digest.cache_clear()
    assert kernels._sources_digest(tmp_path) == after

    seen: list[str] = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: seen.append(kwargs["build_directory"]))
    monkeypatch.setattr(kernels, "spectot_home", lambda: tmp_path / "home")
    kernels._sources_digest.cache_clear()
    if kernels._build_avx2("noise", "torch's ops") is None and not seen:
        pytest.skip("no AVX2 build on this machine")
    assert Path(seen[0]).parent.name == kernels._sources_digest()
    monkeypatch.setattr(kernels, "_sources_digest", lambda: "0123456789abcdef")  # another checkout's sources
    kernels._build_avx2("noise", "torch's ops")
    assert Path(seen[1]).parent.name == "0123456789abcdef"
    assert Path(seen[1]).parent.parent == Path(seen[0]).parent.parent  # the same torch install's folder


def test_a_home_it_cannot_write_falls_back_to_torch(monkeypatch, tmp_path, caplog) -> None:
    """The build folder was made outside the fallback's try: a $SPECTOT_HOME under a file (or read-only) raised
    OSError out of every kernel loader instead of decoding on torch's ops."""
    from spectot.engine import kernels

    if not kernels.cpu_has("avx2", "fma"):
        pytest.skip("no AVX2 build on this machine")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(kernels, "spectot_home", lambda: blocker / "home")  # a folder under a file: mkdir fails
    with caplog.at_level("WARNING"):
        assert kernels._build_avx2("noise", "torch's ops") is None
    assert "could not build the noise kernel" in caplog.text
