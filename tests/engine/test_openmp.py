"""release_thread_pool frees the calling thread's OpenMP workers, so an engine thread that takes
over the model owns the process's only pool (libgomp spins only while it manages <= #CPUs threads)."""

import os
import time
from pathlib import Path

import pytest
import torch

from spectot.engine.openmp import release_thread_pool


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_release_frees_the_calling_threads_openmp_workers():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs on one: a pool needs two
    try:
        _check_release()
    finally:
        torch.set_num_threads(threads)


def _check_release():
    x = torch.ones(1 << 22)
    (x + x).sum()  # a parallel region on this thread: its pool holds one worker
    before = _threads()
    assert release_thread_pool()
    deadline = time.monotonic() + 5
    while _threads() > before - 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # released workers exit on their own
    assert _threads() == before - 1
    assert float((x + x).sum()) == 2 * x.numel()  # the next region gets a fresh pool
    assert _threads() == before
