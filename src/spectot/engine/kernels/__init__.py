"""Native kernels, compiled on first use with torch's extension builder and cached.

``bf16_linear`` (``bf16_linear.cpp``): a batch-invariant bf16 matmul for x86 CPUs with AVX2 + FMA
but no native bf16, where the library kernel's cost grows with every input row. Builds land in
``$SPECTOT_HOME/kernels/<torch version>``; when a build is impossible (no compiler, another CPU)
callers get None and fall back to ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from spectot.models.registry import spectot_home

logger = logging.getLogger(__name__)


def cpu_has(*flags: str) -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(info.split())
    return all(f in words for f in flags)


def cpu_has_native_bf16() -> bool:
    return cpu_has("avx512_bf16") or cpu_has("amx_bf16")


@cache  # one build per process; the compiled module is immutable
def bf16_linear() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma"):
        return None
    from torch.utils.cpp_extension import load

    build = spectot_home() / "kernels" / torch.__version__.replace("+", "_")
    build.mkdir(parents=True, exist_ok=True)
    try:
        module = load(
            name="spectot_bf16_linear",
            sources=[str(Path(__file__).with_name("bf16_linear.cpp"))],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as err:  # a missing compiler or ninja must not stop decoding
        logger.warning("could not build the bf16 linear kernel (%s); using torch's bf16 matmul", err)
        return None
    return module.bf16_linear
