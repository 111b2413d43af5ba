"""The native CPU kernels (``engine/cpu/csrc/*.c``: paged attention, panel GEMM, the fused
residual-add + RMSNorm and RoPE), compiled on first use into one shared library and loaded with
ctypes.

The build needs only a C compiler (``cc``/``gcc``, ``-fopenmp``): it takes a second or two and is
cached under ``$KVRELAY_CACHE_DIR`` (default ``~/.cache/kvrelay``) by a hash of the sources, the
compiler, the flags and the ISA level. It is built for an x86-64 ISA level, never for the build
host (``-march=native``): ``avx512`` (x86-64-v4) or ``avx2`` (x86-64-v3, AVX2 + FMA + F16C), the
best this CPU has, or ``KVRELAY_CPU_ISA`` to force one (forcing a level the CPU lacks is refused
with a message, not run into an illegal instruction). A library built on one host runs on any
other of its level, and a cache shared across CPUs holds one build per level. Where nothing can
be built, :func:`load` returns None and the engine keeps its torch paths (``KVRELAY_NATIVE=0``
forces them).

The ABI (its version and the structs ``cpu/fused_decode.py`` mirrors) is ``csrc/abi.h``'s: the
version is read from there, and ``tests/test_native_abi.py`` checks the ctypes structs against it.

The library links the same OpenMP runtime as torch (``libgomp.so.1``, already loaded by torch
under that soname), so its threads are torch's intra-op threads, not a second pool fighting them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

SOURCES = ("paged_decode.c", "paged_prefill.c", "gemm.c", "pointwise.c", "decode_layer.c",
           "threads.c", "abi.h", "kernels.h", "vec.h")
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast")
ISA_ENV = "KVRELAY_CPU_ISA"


class IsaLevel(NamedTuple):
    name: str
    flags: tuple[str, ...]  # the compiler's
    needs: tuple[str, ...]  # what /proc/cpuinfo must list


# Best first. x86-64-v4 is AVX-512 F/BW/CD/DQ/VL; v3 is AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE.
X86_LEVELS = (
    IsaLevel("avx512", ("-march=x86-64-v4",),
             ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma")),
    IsaLevel("avx2", ("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")),
    IsaLevel("x86-64", (), ()),
)
PORTABLE = IsaLevel("portable", (), ())  # another architecture: the compiler's default target

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _sources() -> list[tuple[str, bytes]]:
    root = resources.files("kvrelay.engine.cpu").joinpath("csrc")
    return [(name, root.joinpath(name).read_bytes()) for name in SOURCES]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _header(name: str) -> str:
    return resources.files("kvrelay.engine.cpu").joinpath("csrc").joinpath(name).read_text()


def abi_version() -> int:
    """``KVR_ABI_VERSION`` of ``csrc/abi.h``: the one place it is written."""
    m = re.search(r"^#define KVR_ABI_VERSION (\d+)$", _header("abi.h"), re.M)
    assert m, "csrc/abi.h defines no KVR_ABI_VERSION"
    return int(m.group(1))


def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for the first CPU (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def isa_levels() -> tuple[IsaLevel, ...]:
    machine = platform.machine().lower()
    return X86_LEVELS if machine in ("x86_64", "amd64") else (PORTABLE,)


def pick_isa(flags: frozenset[str] | None = None, forced: str | None = None) -> IsaLevel:
    """The ISA level to build for: ``forced`` (default ``$KVRELAY_CPU_ISA``) if this CPU has
    it, else the best level it has. Raises ``RuntimeError`` for a forced level it lacks."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get(ISA_ENV) if forced is None else forced
    levels = isa_levels()
    if forced:
        by_name = {lv.name: lv for lv in levels}
        if forced not in by_name:
            raise RuntimeError(f"{ISA_ENV}={forced}: not an ISA level of this machine "
                               f"(choose from {', '.join(by_name)})")
        level = by_name[forced]
        missing = sorted(set(level.needs) - flags)
        if missing:
            raise RuntimeError(f"{ISA_ENV}={forced}, but this CPU lacks {', '.join(missing)}: "
                               f"its code would die of an illegal instruction")
        return level
    return next(lv for lv in levels if set(lv.needs) <= flags)


def cache_root() -> Path:
    """kvrelay's cache: ``$KVRELAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrelay``."""
    return Path(os.environ.get("KVRELAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvrelay"))


def cache_dir() -> Path:
    return cache_root() / "native"


def library_name() -> str:
    """The loaded kernels' file name, which names their sources, flags, compiler and CPU; ""
    where none could be loaded."""
    lib = load()
    return Path(lib._name).name if lib is not None else ""


def build(cc: str | None = None, isa: IsaLevel | None = None) -> Path:
    """Compile the kernels for ``isa`` (default :func:`pick_isa`), if these sources, compiler
    and level have not been built yet, and return the shared library's path. Raises
    ``RuntimeError`` with the compiler's output on failure."""
    isa = isa or pick_isa()
    flags = (*FLAGS, *isa.flags)
    cc = cc or _compiler()
    if cc is None or shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler found ({cc or 'cc/gcc'}); set CC")
    sources = _sources()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join([*(s for _, s in sources), " ".join(flags).encode(),
                                     "".join(version).encode()]))
    out = cache_dir() / f"kvrelay_kernels_{isa.name}_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        files = []
        for name, src in sources:
            (Path(tmp) / name).write_bytes(src)
            if name.endswith(".c"):
                files.append(str(Path(tmp) / name))
        so = Path(tmp) / out.name
        proc = subprocess.run([cc, *flags, "-I", tmp, "-o", str(so), *files],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(so, out)  # atomic: concurrent builders (two workers starting) both succeed
    logger.info("built native kernels for %s: %s", isa.name, out)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    i64, f32, ptr, cint = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    fn = lib.kvr_paged_decode
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i64, i64,
                   cint, cint, ptr]
    fn.restype = cint
    fn = lib.kvr_paged_prefill
    fn.argtypes = [ptr] * 8 + [i64] * 6 + [f32, i64, cint, cint, ptr]
    fn.restype = cint
    for fn in (lib.kvr_gemm_panels_f32, lib.kvr_gemm_panels_bf16):
        fn.argtypes = [ptr] * 4 + [i64] * 3 + [cint, i64]
        fn.restype = cint
    lib.kvr_gemm_panel_width.restype = cint
    lib.kvr_gemm_kblock.restype = cint
    lib.kvr_gemm_tuning.argtypes = [ptr, ptr]
    lib.kvr_gemm_tuning.restype = None
    fn = lib.kvr_add_rmsnorm_f32
    fn.argtypes = [ptr] * 4 + [i64, i64, f32, cint]
    fn.restype = cint
    fn = lib.kvr_rope_f32
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, cint]
    fn.restype = cint
    fn = lib.kvr_silu_mul_f32
    fn.argtypes = [ptr, i64, ptr, i64, i64, cint]
    fn.restype = cint
    lib.kvr_decode_layer_f32.argtypes = [ptr, ptr]
    lib.kvr_decode_layer_f32.restype = cint
    for fn in (lib.kvr_write_kv_f32, lib.kvr_write_kv_bf16):
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, cint]
        fn.restype = cint
    fn = lib.kvr_argmax_rows_f32
    fn.argtypes = [ptr, i64, i64, ptr, cint]
    fn.restype = cint
    lib.kvr_pin_threads.argtypes = [ptr, cint, ptr]
    lib.kvr_pin_threads.restype = cint


def load() -> ctypes.CDLL | None:
    """The kernels, built if needed; None where they cannot be had (then use the torch paths)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("KVRELAY_NATIVE", "1") == "0":
            logger.info("native kernels off (KVRELAY_NATIVE=0)")
            return None
        try:
            torch.get_num_threads()  # torch's OpenMP runtime is loaded before ours
            lib = ctypes.CDLL(str(build()))
            if lib.kvr_abi_version() != abi_version():
                raise RuntimeError(f"stale native library (ABI {lib.kvr_abi_version()}, the "
                                   f"sources' {abi_version()})")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("native kernels unavailable, using the torch paths: %s", e)
            return None
        _declare(lib)
        _lib = lib
        return lib


def available() -> bool:
    return load() is not None
