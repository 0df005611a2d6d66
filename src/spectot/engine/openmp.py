"""OpenMP worker pools when model work moves from one thread to another.

PyTorch's CPU kernels (and spectot's own, ``kernels/``) run on the OpenMP runtime, which on Linux is
libgomp. libgomp keeps one pool of worker threads for every thread that ever ran a parallel region,
and its workers spin between regions only while it manages no more threads than there are CPUs;
past that, each sleeps after 100 spins, and every one of a forward's hundreds of parallel regions
pays a futex wake-up. A model loaded and calibrated on the main thread, then run by an engine
thread, is exactly that case: on the reference 2-core CPU plain greedy decoding fell from 108 to 68
tokens/s on the engine thread.

``release_thread_pool`` frees the calling thread's pool (OpenMP 5's ``omp_pause_resource_all``), so
the thread that takes over the model work owns the only one. The caller gets a fresh pool the next
time it runs a parallel region itself.
"""

from __future__ import annotations

import ctypes
import logging
import re
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime's state
_RUNTIME = re.compile(r"/lib(gomp|omp|iomp5)(-[^/]*)?\.so(\.\d+)*$")  # torch/lib/libgomp.so.1, libgomp-a34b3233.so.1


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; False where no OpenMP 5 runtime is loaded
    (another OS, a build without OpenMP), which leaves nothing to release."""
    pause = _pause_function()
    if pause is None:
        return False
    status = pause(OMP_PAUSE_SOFT)
    if status != 0:  # inside a parallel region: nothing was freed, and nothing needs to be
        logger.debug("omp_pause_resource_all returned %d", status)
    return status == 0


@cache  # the process's loaded OpenMP runtime does not change
def _pause_function():
    """``omp_pause_resource_all`` of the OpenMP runtime this process has loaded (PyTorch's own copy,
    found in the process's memory map so ctypes binds the very library the kernels call), or None."""
    import torch  # noqa: F401  (loads the runtime)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode [path]
        path = fields[5] if len(fields) == 6 else ""
        if _RUNTIME.search(path):
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None
