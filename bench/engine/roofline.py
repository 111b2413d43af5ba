"""The machine's ceilings for bench/engine/throughput.py's roofline ratios: matmul GFLOP/s (the
fastest of MKL's mm, oneDNN's prepacked linear and the native panel GEMM, on the model's own
projection shapes; for bf16 weights also the bf16 panels and, on CPUs with bf16 dot products,
torch's bf16 mm), ``copy_`` bandwidth over a weight-sized buffer and the rate of a read-only
pass over it. Sampled beside each measurement, because this machine's speed drifts minute to
minute. Also the lines naming the panel GEMM's choices that a run measured."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvrelay.engine.cpu import gemm, hugepages, prefetch_tuner


def best(fn: Callable[[], float], reps: int) -> float:
    """The fastest of ``reps`` timings (the least disturbed by a shared machine)."""
    return min(fn() for _ in range(reps))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- ceilings ----------------------------------------------------------------------------------
def bf16_dot_products() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class Ceilings:
    """Samples of the machine's matmul rate and copy bandwidth, for weights of ``dtype``.

    The matmul ceiling is the fastest kernel this machine has for the arithmetic a step of that
    dtype can use: fp32 (MKL's mm, oneDNN's prepacked linear, the native panels); for bf16
    weights also the bf16 panels (fp32 arithmetic over weights widened in registers) and
    torch's bf16 mm (oneDNN, which uses bf16 dot products or AMX where the CPU has them: then
    the ceiling is that rate, not fp32's)."""

    def __init__(self, hidden: int, inter: int, weight_bytes: int,
                 dtype: torch.dtype = torch.float32):
        m = 2048
        shapes = [(hidden, inter), (inter, hidden), (hidden, hidden)]
        self._mm = [(torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)) for k, n in shapes]
        self._packed = []
        if torch.backends.mkldnn.is_available():
            try:
                self._packed = [(x, torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(),
                                                                            None))
                                for x, w, _ in self._mm]
            except (RuntimeError, AttributeError):
                self._packed = []
        self._panels = []
        if gemm.available():
            kb = gemm.default_kblock()
            weights = [dtype] if dtype == torch.float32 else [torch.float32, dtype]
            self._panels = [(x, gemm.pack_panels(w.t().contiguous().to(wd), kb), o.shape[1], kb)
                            for wd in weights for x, w, o in self._mm]
        # Only where the CPU multiplies bf16 itself: elsewhere oneDNN widens it slowly (seconds
        # for these shapes on an AVX2 host), far below the fp32 kernels.
        self._narrow_mm = [] if dtype == torch.float32 or not bf16_dot_products() else \
            [(x.to(dtype), w.to(dtype)) for x, w, _ in self._mm]
        self._flops = sum(2 * m * k * n for k, n in shapes)
        elem = 4
        self._src = torch.randn(weight_bytes // elem)
        self._dst = torch.empty_like(self._src)
        self._bytes = 2 * self._src.numel() * elem
        self.gflops(), self.copy_gbs()  # warm-up

    def _onednn(self) -> None:
        for x, w in self._packed:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def gflops(self) -> float:
        """GFLOP/s of one pass over the projection shapes, by the fastest kernel."""
        t = timed(lambda: [torch.mm(x, w, out=o) for x, w, o in self._mm])
        if self._packed:
            t = min(t, timed(self._onednn))
        threads = torch.get_num_threads()
        n_shapes = len(self._mm)
        for i in range(0, len(self._panels), n_shapes):  # per weight dtype
            group = self._panels[i:i + n_shapes]
            t = min(t, timed(lambda g=group: [gemm.panel_linear(x, p, None, n, threads, kb)
                                               for x, p, n, kb in g]))
        if self._narrow_mm:
            t = min(t, timed(lambda: [torch.mm(x, w) for x, w in self._narrow_mm]))
        return self._flops / t / 1e9

    def read_gbs(self) -> float:
        """GB/s of one read-only pass over a weight-sized buffer (the faster of a sum and a max:
        a decode step reads its weights and writes next to nothing, and on some hosts a read
        stream runs well above or below half of ``copy_``'s read+write rate)."""
        t = min(timed(self._src.sum), timed(self._src.amax))
        return self._src.numel() * 4 / t / 1e9

    def copy_gbs(self) -> float:
        """GB/s (read + write) of one weight-sized ``copy_``."""
        return self._bytes / timed(lambda: self._dst.copy_(self._src)) / 1e9


# -- kernel choices ----------------------------------------------------------------------------
def gemm_tuning() -> str:
    """The panel GEMM's per-CPU choices (they differ between vendors), for the header."""
    if not gemm.available():
        return "no panel GEMM"
    t = gemm.picked_tuning()
    fused = f"fused order up to {t.fuse_rows} rows" if t.fuse_rows else "no fused order"
    packed = f"k-major rows from K {t.pack_min_k}" if t.pack_min_k else "rows read in place"
    if (kb := gemm.default_kblock()) > 0:  # the k-major copy is for one-block weights only
        packed = f"weights in {kb}-row K blocks (one-block weights: {packed})"
    pages = "huge pages" if hugepages.enabled() else "small pages"
    tuned = " (decode steps: tuned online)" if prefetch_tuner.applies() else ""
    return (f"gemm: {fused}, balanced chunks {'on' if t.balance else 'off'}, "
            f"next-panel prefetch from {t.pf_min_rows} rows{tuned}, {packed}; panels on {pages}")


def prefetch_note(runner: object) -> str | None:
    """The online next-panel prefetch choices of ``runner``'s engine (None: it has no tuner)."""
    snap = prefetch_tuner.snapshot(runner)
    if snap is None:
        return None

    def sizes(on: bool) -> str:
        return ", ".join(str(r) for r, v in snap.choices.items() if v is on) or "none"

    return (f"next-panel prefetch after {snap.probes} probes: on at batch {sizes(True)}; "
            f"off at {sizes(False)}")
