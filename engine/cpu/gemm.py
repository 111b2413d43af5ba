"""Linear layers through the native panel GEMM (``engine/cpu/csrc/gemm.c``) on the CPU: fp32
activations, fp32 or bf16 weights.

The weight ``[N, K]`` is stored once as ``P = ceil(N / NR)`` panels ``[P, K, NR]`` (NR output
columns each, zero padded): one panel is a single sequential stream, and the kernel's register
tile (up to 6 rows x 16 columns with AVX2, 12 x 32 with AVX-512) takes each weight element from
it once per 6 (12) rows. The threads split the panels, so at decode-sized row counts every
weight is read from memory exactly once per step, at the stream bandwidth; at prefill sizes the
same tile runs compute-bound. Measured on a 2-core AMD EPYC (Zen 3, AVX2), ~150M demo model's
projection shapes, against oneDNN's prepacked linear: 1.2-1.36x faster at 1-64 rows, 1.2x at
128-512 and 1.1x at 2048 (``bench.engine.throughput`` samples both side by side; the loader
picks per machine, see :func:`kvrelay.engine.cpu.kernel_choice.choose_linear_kernel`).

bf16 weights are packed in the same layout, as bf16: the kernel widens them to fp32 in registers
and accumulates in fp32 (the product is ``x @ W.float().T`` up to the order of the sums, the
same order as an fp32 copy of the weight), streaming half the bytes per call
(``python -m bench.engine.gemm_bf16`` pairs the two).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch

from kvrelay.engine.cpu import native

UNAVAILABLE = "the native panel GEMM is unavailable on this machine"
_KERNELS = {torch.float32: "kvr_gemm_panels_f32", torch.bfloat16: "kvr_gemm_panels_bf16"}


def panel_width() -> int:
    """Output columns per panel of this machine's kernel; 0 where there is none (no AVX2+FMA
    or no compiler)."""
    lib = native.load()
    return int(lib.kvr_gemm_panel_width()) if lib is not None else 0


def available() -> bool:
    return panel_width() > 0


def next_panel_prefetch() -> bool:
    """Whether this machine's kernel can prefetch a thread's next panel (``Tuning.pf_min_rows``):
    only the AVX-512 build (32-column panels) has it."""
    return panel_width() == 32


def default_kblock() -> int:
    """K rows per block of the layout :func:`pack_panels` picks for this CPU (``gemm.c``'s
    ``kvr_gemm_kblock``: 768 on AMD's AVX-512 cores, where a decode-sized call then runs block
    by block; 0 elsewhere: one block)."""
    lib = native.load()
    if lib is None:
        raise RuntimeError(UNAVAILABLE)
    return int(lib.kvr_gemm_kblock())


def pack_panels(w: torch.Tensor, kblock: int | None = None) -> torch.Tensor:
    """``w`` (``[N, K]``) as ``P = ceil(N / NR)`` panels of NR columns, zero padded, in blocks
    of ``kblock`` of its K rows (default :func:`default_kblock`; 0, or K or more: one block),
    each block's rows of every panel together: ``[P, kn, NR]`` per block, so one block is the
    plain ``[P, K, NR]``. The result has that shape whatever the blocks (their order is the
    kernel's business, as with oneDNN's packed weights): pass the same ``kblock`` to
    :func:`panel_linear`. The panels keep ``w``'s dtype (fp32 or bf16)."""
    nr = panel_width()
    if nr == 0:
        raise RuntimeError(UNAVAILABLE)
    kb = default_kblock() if kblock is None else kblock
    n, k = w.shape
    p = -(-n // nr)
    padded = w.new_zeros(p * nr, k)
    padded[:n] = w
    panels = padded.view(p, nr, k).transpose(1, 2)  # [P, K, NR], not yet contiguous
    if kb <= 0 or kb >= k:
        return panels.contiguous()
    blocks = [panels[:, k0:k0 + kb].contiguous().view(-1) for k0 in range(0, k, kb)]
    return torch.cat(blocks).view(p, k, nr)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int, threads: int, kblock: int) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` ``[M, K]`` (fp32, CPU) over :func:`pack_panels`' layout
    (packed with ``kblock``), fp32 or bf16 panels; the bias fp32 (or None), the result fp32."""
    lib = native.load()
    assert lib is not None
    fn = _KERNELS.get(panels.dtype)
    assert fn is not None, f"no panel GEMM for {panels.dtype} weights"
    assert x.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
    assert panels.is_contiguous()
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    assert k == panels.shape[1], (k, tuple(panels.shape))
    y = x.new_empty(m, out_features)
    rc = getattr(lib, fn)(x.data_ptr(), panels.data_ptr(),
                          None if bias is None else bias.data_ptr(), y.data_ptr(),
                          m, k, out_features, threads, kblock)
    if rc != 0:
        raise RuntimeError(f"native panel GEMM failed ({rc})")
    return y


@dataclass(frozen=True)
class Tuning:
    """The kernel's choices that measured differently on different cores (``gemm.c``'s
    ``tuning``, picked for the CPU when the library loads): the largest row count that takes the
    one-pass fused order (0: none), whether row chunks are always balanced, the fewest rows
    that prefetch the thread's next panel beside their own (AVX-512 only), and the smallest K
    whose calls of a few rows read the input from a k-major copy (0: never)."""

    fuse_rows: int
    balance: bool
    pf_min_rows: int
    pack_min_k: int


_current: Tuning | None = None  # the kernel's tuning as last read or set here
_picked: Tuning | None = None  # the one the library picked for this CPU when it loaded


def tuning(set_to: Tuning | None = None) -> Tuning:
    """The kernel's tuning; with ``set_to`` it is replaced (process-wide: for tests and paired
    benchmarks, and between steps, not while one runs) and the previous one returned."""
    global _current, _picked
    lib = native.load()
    if lib is None:
        raise RuntimeError(UNAVAILABLE)
    out = (ctypes.c_int * 4)()
    new = None if set_to is None else (ctypes.c_int * 4)(
        set_to.fuse_rows, int(set_to.balance), set_to.pf_min_rows, set_to.pack_min_k)
    lib.kvr_gemm_tuning(out, new)
    before = Tuning(out[0], bool(out[1]), out[2], out[3])
    _picked = _picked or before  # nothing sets it but through here
    _current = set_to or before
    return before


def picked_tuning() -> Tuning:
    """The tuning the library picked for this CPU when it loaded, whatever has been set since
    (the prefetch tuner moves ``pf_min_rows`` between steps)."""
    tuning()
    assert _picked is not None
    return _picked


def set_prefetch_min_rows(rows: int) -> None:
    """The tuning's ``pf_min_rows`` set to ``rows``, the rest kept (no native call when it
    already is: the prefetch tuner calls this before every decode step)."""
    cur = _current if _current is not None else tuning()
    if cur.pf_min_rows != rows:
        tuning(replace(cur, pf_min_rows=rows))
