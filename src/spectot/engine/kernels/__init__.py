"""Native kernels, compiled on first use with torch's extension builder and cached.

``bf16_linear`` (``bf16_linear.cpp``): a batch-invariant bf16 matmul over weights packed once into panels
whose vector lanes are output columns (no horizontal sums): AVX2 + FMA (where the library kernel's cost grows
with every input row; a shift and an AND widen 16 weights), built with AVX512-BF16 where the CPU has it
(native bf16 pairs, no conversions) and with AMX tiles where it has those.

``tree_attention`` (``tree_attention.cpp``): batch-invariant attention of query rows over CSR lists
of KV-cache slots (bf16 or fp32, GQA): a row's output depends only on its query and the K/V rows at
its columns, in order, so a tree forward reproduces the AR step bit for bit without float64.

``decoder_ops`` (``decoder_ops.cpp``): a Llama-family layer's small bf16 ops (RMSNorm, rotary + KV
write, SwiGLU gate) as one call each, row-wise in a fixed order.

``decoder_stack`` (``decoder_stack.cpp``): the runner's whole layer loop in one call over the kernels above
(compiled into it), with the same results as the loop.

``noise_ops`` (``noise.cpp``): sampled decoding's counter-based coupled noise E_i = -log u_i at any token ids, and the
draw argmax p / E without drawing all of it.

Builds land in ``$SPECTOT_HOME/kernels/<torch version>-<torch path hash>/<sources digest>/<module>`` (e.g.
``2.13.0_cpu-1a2b3c4d/0123456789abcdef/spectot_noise``: two environments with the same torch at different paths, or
two checkouts with different kernel sources, keep their own builds instead of rebuilding each other's),
one build at a time per folder under an OS file lock that a killed build cannot leave behind; when a build is
impossible (another CPU, no compiler or ninja) the loaders return None and callers fall back to torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

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


def _build_avx2(source: str, fallback: str, avx512_bf16: bool = False, amx: bool = False) -> Any | None:
    """The extension module built from ``<source>.cpp`` (AVX2 + FMA, OpenMP; with ``avx512_bf16`` also
    the AVX512-BF16 instructions, which the source then uses), or None with a logged warning naming
    ``fallback`` when this machine cannot build or run it."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma"):
        return None
    from torch.utils.cpp_extension import load

    name = f"spectot_{source}" + ("_avx512bf16" if avx512_bf16 else "") + ("_amx" if amx else "")
    torch_key = _torch_build_key(torch.__version__, Path(torch.__file__).parent.resolve())
    # one folder per build: torch install x kernel sources x module x ISA
    build = spectot_home() / "kernels" / torch_key / _sources_digest() / name
    isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"] if avx512_bf16 else []
    isa += ["-mamx-tile", "-mamx-bf16"] if amx else []
    try:
        build.mkdir(parents=True, exist_ok=True)  # in the try: a $SPECTOT_HOME it cannot write falls back too
        with _exclusive_build(build, source), _package_ninja_first():
            if not _built(build, name):
                logger.info("building the %s kernel (first use; a few minutes)", source)
            else:
                logger.debug("loading the %s kernel from %s", source, build)
            return load(
                name=name,
                sources=[str(Path(__file__).with_name(f"{source}.cpp"))],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", *isa],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except Exception as err:  # a missing compiler or ninja must not stop decoding
        logger.warning("could not build the %s kernel (%s); using %s", source, err, fallback)
        return None


@cache
def _sources_digest(folder: Path = Path(__file__).parent) -> str:
    """16 hex digits of every kernel source in ``folder`` (``.cpp``, ``.h``), the name of their builds' folder: new
    sources build anew however old their timestamps (ninja compares timestamps only, and an archive, ``cp -p`` or a
    checkout can give a new source an mtime before the build's), and two checkouts with different sources sharing
    ``$SPECTOT_HOME`` keep their own builds instead of rebuilding each other's on every alternation."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _torch_build_key(version: str, torch_dir: Path) -> str:
    """The kernels folder of one torch installation: its version, readable, and 8 hex digits of its path, e.g.
    ``2.13.0_cpu-1a2b3c4d`` for torch 2.13.0+cpu. Keyed by version alone, two environments with the same torch at
    different paths rebuilt each other's kernels whenever they alternated: each build command names its own
    torch's headers, so ninja took the other's build for a changed command."""
    digest = hashlib.sha256(str(torch_dir).encode()).hexdigest()[:8]
    return f"{version.replace('+', '_')}-{digest}"


def _built(build: Path, name: str) -> bool:
    """Whether ``build`` (a folder of these very sources) holds the module already: loading it then compiles nothing
    (else the first use of the kernel builds it for a few minutes, which is announced)."""
    return (build / (name + (".pyd" if os.name == "nt" else ".so"))).exists()


@contextmanager
def _exclusive_build(build: Path, source: str) -> Iterator[None]:
    """Hold ``<build>/.spectot-build.lock`` (flock, exclusive) while torch's builder runs in ``build``.

    torch's own baton is a file, ``<build>/lock``, made with O_EXCL; other processes wait until it disappears, so a
    build killed midway (Ctrl-C, a test timeout) left it behind and every later run hung silently. The OS drops a
    flock when its holder dies, and every spectot build here takes this one first, so a ``lock`` file found while
    holding it is stale: it is removed. Without fcntl (Windows) only torch's baton guards the folder."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(build / ".spectot-build.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the %s kernel in %s", source, build)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            logger.warning("removing %s, left by an interrupted build of the %s kernel", stale, source)
            stale.unlink(missing_ok=True)
        yield  # closing the file releases the flock


@contextmanager
def _package_ninja_first() -> Iterator[None]:
    """PATH with the `ninja` package's binary (a dependency) first while torch's builder runs `ninja`, which it finds
    on PATH. Every entry point then builds with that one ninja, with or without an activated environment: two
    ninja versions log their commands differently, so each took the other's build for a changed command and
    rebuilt it (measured: `spectot` with the environment's 1.13 on PATH and `python` with the system's 1.11
    rebuilt the native layer loop and the noise kernel, ~1.5 minutes, every time they alternated)."""
    try:
        import ninja
    except ImportError:  # no package: whatever ninja PATH has
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, before]) if before else ninja.BIN_DIR
    try:
        yield
    finally:
        if before is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = before


def _wide_isa() -> dict[str, bool]:
    """The wider instruction sets this CPU offers a build: AVX512-BF16, and AMX's bf16 tiles beside it."""
    avx512_bf16 = cpu_has("avx512_bf16")
    return {"avx512_bf16": avx512_bf16, "amx": avx512_bf16 and cpu_has("amx_tile", "amx_bf16")}


@cache  # one build per process; the compiled module is immutable
def bf16_linear() -> Any | None:
    """The module with ``pack(W) -> packed`` (once per weight (N, K) bf16) and ``linear(x, packed, bias,
    N) -> x W^T + b`` (bf16, batch-invariant), or None where it cannot be built."""
    return _build_avx2("bf16_linear", "torch's bf16 matmul", **_wide_isa())


@cache  # one build per process; the compiled module is immutable
def tree_attention() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """``tree_attention(q, kv, columns, row_ptr, scale) -> out``, or None where it cannot be built.

    q (H, N, D) and kv (capacity, 2, H_kv, D), contiguous, both bf16 or both fp32, D a multiple of 8,
    H a multiple of H_kv (query head h reads kv head h // (H // H_kv)); kv[slot, 0] are keys and
    kv[slot, 1] values. Row r attends to slots columns[row_ptr[r] : row_ptr[r + 1]] (int64, at least
    one each). Returns out (H, N, D) fp32, out[h, r] = softmax(scale * q[h, r] k^T) v over those slots; with
    ``rows_bf16=True`` (bf16 inputs) the same values rounded to bf16 in row-major (N, H * D), the o-projection's
    input, equal to ``out.to(torch.bfloat16).transpose(0, 1).reshape(N, -1)`` without those three ops.
    Raises RuntimeError on inputs it does not take (the runner hands it only shapes it takes:
    ``pick_attention_kernel``).
    """
    module = _build_avx2("tree_attention", "torch attention", **_wide_isa())
    return None if module is None else module.tree_attention


@cache  # one build per process; the compiled module is immutable
def decoder_ops() -> Any | None:
    """The module with ``rms_norm(x, weight, eps)``, ``rope_store(qkv, cos, sin, new_kv, Hq, Hkv) -> q``
    and ``silu_mul(gate_up)`` (see ``decoder_ops.cpp``), or None where it cannot be built."""
    return _build_avx2("decoder_ops", "torch's ops")


@cache  # one build per process; the compiled module is immutable
def noise_ops() -> Any | None:
    """``exponential(key, ids)`` and ``race(probs, key)``: a position's counter-based coupled noise and the draw
    argmax p / E over it (see ``noise.cpp``), or None where it cannot be built."""
    return _build_avx2("noise", "numpy's uint64 arithmetic")


@cache  # one build per process; the compiled module is immutable
def decoder_stack() -> Any | None:
    """The module with ``DecoderStack(q_heads, kv_heads)`` (``add_layer``, then ``forward``: see
    ``decoder_stack.cpp``), or None where it cannot be built. Built with the same instruction sets as
    ``bf16_linear`` and ``tree_attention``, whose sources it compiles in."""
    return _build_avx2("decoder_stack", "the runner's layer loop", **_wide_isa())
