"""The native CPU kernels (``engine/csrc/*.c``: paged attention, panel GEMM, the fused
residual-add + RMSNorm and RoPE), compiled on first
use into one shared library and loaded with ctypes.

The build needs only a C compiler (``cc``/``gcc``, ``-fopenmp``): it takes a second or two and is
cached under ``$KVRELAY_CACHE_DIR`` (default ``~/.cache/kvrelay``) by a hash of the sources, the
compiler and the flags, so each machine builds it once. ``-march=native`` is safe because the
library is built on the machine that runs it (a cache directory shared across different CPUs is
keyed by the CPU's model and flags too). Where nothing can be built, :func:`load` returns None and
the engine keeps its torch paths (``KVRELAY_NATIVE=0`` forces them).

The library links the same OpenMP runtime as torch (``libgomp.so.1``, already loaded by torch
under that soname), so its threads are torch's intra-op threads, not a second pool fighting them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ABI_VERSION = 17
SOURCES = ("paged_decode.c", "paged_prefill.c", "gemm.c", "pointwise.c", "decode_layer.c",
           "threads.c", "kernels.h", "vec.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _sources() -> list[tuple[str, bytes]]:
    root = resources.files("kvrelay.engine").joinpath("csrc")
    return [(name, root.joinpath(name).read_bytes()) for name in SOURCES]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_key() -> str:
    """The CPU model and feature flags (``-march=native`` code runs only where they match)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags") and key not in fields:
            fields[key] = value.strip()
    return f"{platform.machine()}|{fields.get('model name', '')}|{fields.get('flags', '')}"


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


def build(cc: str | None = None) -> Path:
    """Compile the kernels (if these sources/compiler/CPU have not been built yet) and return the
    shared library's path. Raises ``RuntimeError`` with the compiler's output on failure."""
    cc = cc or _compiler()
    if cc is None or shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler found ({cc or 'cc/gcc'}); set CC")
    sources = _sources()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join([*(s for _, s in sources), " ".join(FLAGS).encode(),
                                     "".join(version).encode(), _cpu_key().encode()]))
    out = cache_dir() / f"kvrelay_kernels_{key.hexdigest()[:16]}.so"
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
        proc = subprocess.run([cc, *FLAGS, "-I", tmp, "-o", str(so), *files],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(so, out)  # atomic: concurrent builders (two workers starting) both succeed
    logger.info("built native kernels: %s", out)
    return out


def _declare(lib: ctypes.CDLL) -> None:
    i64, f32, ptr, cint = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    fn = lib.kvr_paged_decode_f32
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i64, i64,
                   cint]
    fn.restype = cint
    fn = lib.kvr_paged_prefill_f32
    fn.argtypes = [ptr] * 8 + [i64] * 6 + [f32, i64, cint]
    fn.restype = cint
    fn = lib.kvr_gemm_panels_f32
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
    fn = lib.kvr_write_kv_f32
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
            if lib.kvr_abi_version() != ABI_VERSION:
                raise RuntimeError("stale native library (ABI version mismatch)")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("native kernels unavailable, using the torch paths: %s", e)
            return None
        _declare(lib)
        _lib = lib
        return lib


def available() -> bool:
    return load() is not None
