"""Native CPU kernels (``csrc/paged_attention.c``), compiled on first use and loaded with ctypes.

Decode attention on the CPU is memory-bound: each step reads every running sequence's cached K/V
once per layer. Done with torch ops it cannot avoid gathering the paged blocks into a contiguous
buffer first (a read and a write of the whole context) and then reading that again in SDPA,
whose CPU kernel is tuned for long query blocks rather than one query row: at batch 64 x 500
tokens that is ~5x the bytes and time of reading the cache once (measured, ~150M demo model).
The C kernel reads each sequence's K/V rows straight out of the paged cache through its block
table, once.

The build needs only a C compiler (``cc``/``gcc``, ``-fopenmp``): it takes under a second and is
cached under ``$KVRELAY_CACHE_DIR`` (default ``~/.cache/kvrelay``) by a hash of the source, the
compiler and the flags, so each machine builds it once. ``-march=native`` is safe because the
library is built on the machine that runs it (a cache directory shared across different CPUs is
keyed by the CPU's model and flags too). Where nothing can be built, :func:`load` returns None
and the engine keeps the pure-torch path (``KVRELAY_NATIVE=0`` forces that path).

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

from kvrelay.engine.attention.metadata import AttentionMetadata
from kvrelay.engine.attention.sdpa import prefill_attention, zero_padding

logger = logging.getLogger(__name__)

ABI_VERSION = 3
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast")
# Fewest keys in one decode work item: the kernel cuts a sequence's context into partitions of
# at least this many keys, so a small batch with long contexts still gives every thread work
# (the partial softmaxes merge exactly).
MIN_PART_TOKENS = 256

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _source() -> bytes:
    return resources.files("kvrelay.engine.attention").joinpath(
        "csrc/paged_attention.c").read_bytes()


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


def cache_dir() -> Path:
    root = os.environ.get("KVRELAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvrelay")
    return Path(root) / "native"


def build(cc: str | None = None) -> Path:
    """Compile the kernels (if this source/compiler/CPU has not been built yet) and return the
    shared library's path. Raises ``RuntimeError`` with the compiler's output on failure."""
    cc = cc or _compiler()
    if cc is None or shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler found ({cc or 'cc/gcc'}); set CC")
    src = _source()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), "".join(version).encode(),
                                     _cpu_key().encode()])).hexdigest()[:16]
    out = cache_dir() / f"kvrelay_attention_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        c_file = Path(tmp) / "paged_attention.c"
        c_file.write_bytes(src)
        so = Path(tmp) / out.name
        proc = subprocess.run([cc, *FLAGS, "-o", str(so), str(c_file)], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(so, out)  # atomic: concurrent builders (two workers starting) both succeed
    logger.info("built native attention kernels: %s", out)
    return out


def load() -> ctypes.CDLL | None:
    """The kernels, built if needed; None where they cannot be had (then use the torch path)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("KVRELAY_NATIVE", "1") == "0":
            logger.info("native attention kernels off (KVRELAY_NATIVE=0)")
            return None
        try:
            torch.get_num_threads()  # torch's OpenMP runtime is loaded before ours
            lib = ctypes.CDLL(str(build()))
            if lib.kvr_abi_version() != ABI_VERSION:
                raise RuntimeError("stale native library (ABI version mismatch)")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("native attention kernels unavailable, using torch SDPA: %s", e)
            return None
        i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        fn = lib.kvr_paged_decode_f32
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i64, i64,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        fn = lib.kvr_paged_prefill_f32
        fn.argtypes = [ptr] * 8 + [i64] * 6 + [f32, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        _lib = lib
        return lib


def available() -> bool:
    return load() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, ctx_lens: torch.Tensor, out: torch.Tensor,
                 block_size: int, scale: float, window: int | None) -> torch.Tensor:
    """Decode attention of ``q [N, H, D]`` over the paged caches (flat ``[slots, KVH, D]``),
    sequence ``i`` seeing its first ``ctx_lens[i]`` keys through ``block_tables[i]`` (int32,
    ``[N, W]``). Writes and returns ``out [N, H, D]``; every tensor contiguous fp32 on CPU."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    n, h, d = q.shape
    kvh = k_cache.shape[1]
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int32
    rc = lib.kvr_paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        ctx_lens.data_ptr(), out.data_ptr(), n, h, kvh, d, block_size, block_tables.shape[1],
        scale, window or 0, MIN_PART_TOKENS, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native paged decode attention failed ({rc})")
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, spans: torch.Tensor, out: torch.Tensor,
                  block_size: int, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention of prefill spans over the paged caches. ``spans`` is int32 ``[3, S]``:
    each span's first row in ``q [T, H, D]``, its row count, and the keys visible to its last
    row (cached prefix plus its new tokens, whose K/V are already in the caches);
    ``block_tables`` int32 ``[S, W]``. Writes the spans' rows of ``out [T, H, D]``."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    h, d = q.shape[1], q.shape[2]
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int32
    assert spans.dtype == torch.int32 and spans.is_contiguous()
    n = spans.shape[1]
    rc = lib.kvr_paged_prefill_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        spans[0].data_ptr(), spans[1].data_ptr(), spans[2].data_ptr(), out.data_ptr(), n, h,
        k_cache.shape[1], d, block_size, block_tables.shape[1], scale, window or 0,
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native paged prefill attention failed ({rc})")
    return out


def native_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, window: int | None,
) -> torch.Tensor:
    """The CPU backend: every prefill span of the step in one call of the paged prefill kernel
    (torch SDPA where the head size is not a multiple of 16), every decode in one call of the
    paged decode kernel."""
    out = torch.empty_like(q)
    if meta.prefill_spans is not None:
        assert meta.prefill_tables is not None
        paged_prefill(q, k_cache, v_cache, meta.prefill_tables, meta.prefill_spans, out,
                      meta.block_size, scale, window)
    else:
        prefill_attention(q, k, v, k_cache, v_cache, meta, scale, window, out)
    if meta.decode_lens is not None:
        p, e = meta.num_prefill_tokens, meta.num_prefill_tokens + meta.num_decodes
        assert meta.decode_tables is not None
        paged_decode(q[p:e], k_cache, v_cache, meta.decode_tables, meta.decode_lens, out[p:e],
                     meta.block_size, scale, window)
    zero_padding(out, meta)
    return out
