"""The machine's ceilings for bench/engine/throughput.py's roofline ratios: fp32 matmul GFLOP/s (the
fastest of MKL's mm, oneDNN's prepacked linear and the native panel GEMM, on the model's own
projection shapes), ``copy_`` bandwidth over a weight-sized buffer and the rate of a read-only
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
class Ceilings:
    """Samples of the machine's fp32 matmul rate and copy bandwidth."""

    def __init__(self, hidden: int, inter: int, weight_bytes: int):
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
            self._panels = [(x, gemm.pack_panels(w.t().contiguous(), kb), o.shape[1], kb)
                            for x, w, o in self._mm]
        self._flops = sum(2 * m * k * n for k, n in shapes)
        self._src = torch.randn(weight_bytes // 4)
        self._dst = torch.empty_like(self._src)
        self._bytes = 2 * self._src.numel() * 4
        self.gflops(), self.copy_gbs()  # warm-up

    def _onednn(self) -> None:
        for x, w in self._packed:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def gflops(self) -> float:
        """fp32 GFLOP/s of one pass over the projection shapes, by the faster kernel."""
        t = timed(lambda: [torch.mm(x, w, out=o) for x, w, o in self._mm])
        if self._packed:
            t = min(t, timed(self._onednn))
        if self._panels:
            threads = torch.get_num_threads()
            t = min(t, timed(lambda: [gemm.panel_linear(x, p, None, n, threads, kb)
                                      for x, p, n, kb in self._panels]))
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
