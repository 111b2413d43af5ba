"""Which CPU kernel a model's linears are packed for at load, and what ``--linear-kernel auto``
measured, kept for the next engine of the same kind.

The choice between the native panel GEMM and oneDNN (:func:`choose_linear_kernel`) times both on
the model's own linears at load, from 8 rows to a full prefill step's: a fraction of a second on
the ~7M model, longer on larger ones, and on a busy machine a coin toss between two close kernels,
so replicas of one deployment could differ. The result (the kernel, and the rows up to which
``mixed`` takes the panels) is kept in one small JSON file per key under the cache directory,
beside the native build: the native kernels' build (its name holds their sources, flags, compiler
and CPU), the torch build, the thread count, the rows a prefill step was timed at (the engine's
token budget), every linear's shape (a tensor-parallel shard has its own) and the weights' dtype
(fp32 or bf16: other kernels, other timings). A later engine of the same key packs only the kept
kernel. Delete ``$KVRELAY_CACHE_DIR/linear_kernel`` to measure again.

bf16 weights (a bf16 checkpoint under ``--dtype auto``) compete the same way, between bf16
panels and oneDNN's bf16 linear; where this CPU has no oneDNN bf16 (AVX2-only cores, see
:func:`~kvrelay.engine.cpu.packed_linear.onednn_packing_available`) the panels are packed
without timing, as they are for fp32 where oneDNN is missing. torch's own bf16 ``F.linear`` is
no candidate: on the 2-core Zen 3 (AVX2, no oneDNN bf16), per layer of the ~150M demo model's
linears, 2 threads, fp32 rows in and out (the conversions timed), it took 1.6 / 8.8 / 34 / 600 /
4850 ms at 1 / 8 / 32 / 512 / 2048 rows against the bf16 panels' 1.06 / 2.0 / 5.5 / 91 / 876;
paired rounds on the busy shared host put it 1.6-3.6x, 2.9-6.9x, 4.9-7.4x and 4.8-6.8x slower
from 8 rows on (at 1 row 1.4x slower idle, 0.6x once under heavy load). The fp32 panels took
1.98 / 2.6 / 6.3 / 73 / 751: where the GEMM is compute-bound the bf16 panels' widening costs
1-2% (paired at 512 and 2048 rows: 0.98x, 0.99x; up to 14% before prefill-sized calls widened
each panel once) and where it streams it halves the bytes (1.85x faster at 1 row); no fp32
copy of the weights is kept for that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvrelay.engine.cpu import hugepages, native, packed_linear
from kvrelay.engine.cpu.packed_linear import (
    LINEAR_KERNELS,
    MIXED_PANEL_ROWS,
    PackedLinear,
    onednn_packing_available,
    packed,
    panels_available,
)
from kvrelay.engine.models.linear import Linear

if TYPE_CHECKING:
    from kvrelay.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# The most rows ``linear_kernel=auto`` times a prefill-sized pass at (a full step of the default
# token budget): ~0.2 s a pass of one layer of the ~150M demo model.
PREFILL_ROWS = 2048


def cache_key(shapes: Sequence[tuple[int, int]], threads: int, prefill_rows: int,
              dtype: torch.dtype) -> str:
    text = "|".join([native.library_name(), torch.__version__, str(threads), str(prefill_rows),
                     ";".join(f"{a}x{b}" for a, b in shapes), str(dtype)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _path(key: str) -> Path:
    return native.cache_root() / "linear_kernel" / f"{key}.json"


def load(key: str) -> tuple[str, int] | None:
    """The kernel kept for ``key`` and the rows up to which ``mixed`` takes the panels, or None
    (never measured, or an unreadable file)."""
    try:
        doc = json.loads(_path(key).read_text())
        kernel, panel_rows = doc["kernel"], int(doc["panel_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (kernel, panel_rows) if kernel in ("panels", "onednn", "mixed") else None


def save(key: str, kernel: str, panel_rows: int, measured: dict[str, float]) -> None:
    """Keep ``kernel`` for ``key`` (atomically: concurrent engines may race to write it)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"kernel": kernel, "panel_rows": panel_rows, "measured_ms": measured}, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measure again next time
        logger.debug("could not keep the linear kernel choice in %s: %s", path, e)


# -- a model's linears -------------------------------------------------------------------------
def linears(model: LlamaForCausalLM) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def pack_weights(model: LlamaForCausalLM, *, onednn: bool = True, panels: bool = False) -> None:
    """Repack every linear for oneDNN and/or the panel GEMM (CPU, fp32 or bf16 weights), after
    the weights are loaded (see :class:`~kvrelay.engine.cpu.packed_linear.PackedLinear`); a
    tied LM head packs the embedding."""
    for m in linears(model):
        if m is not model.lm_head:
            packed_linear.pack(m, onednn=onednn, panels=panels)
    packed_linear.pack(model.lm_head, model.embed if model.arch.tie_word_embeddings else None,
                       onednn=onednn, panels=panels)


def weight_dtype(model: LlamaForCausalLM) -> torch.dtype:
    """The dtype the (unpacked) linears' weights are stored in: the checkpoint's as loaded."""
    return next(m.weight.dtype for m in linears(model) if m.weight is not None)


def linear_shapes(model: LlamaForCausalLM) -> list[tuple[int, int]]:
    """``(in, out)`` of every linear, in module order (what a kernel choice is made for)."""
    return [(-1, m.out_features) if m.weight is None else (m.weight.shape[1], m.weight.shape[0])
            for m in linears(model)]


def linear_kernel(model: LlamaForCausalLM) -> str:
    """Which copies the linears hold: ``panels``, ``onednn``, ``mixed`` or ``dense``."""
    k = packed(model.layers[0].attn.o)  # every layer has one (an MoE layer has no mlp.down)
    if k is None:
        return "dense"
    if k.panels is not None:
        return "mixed" if k.onednn is not None else "panels"
    return "onednn"


def keep_linear_kernel(model: LlamaForCausalLM, kernel: str,
                       panel_rows: int = MIXED_PANEL_ROWS) -> None:
    """From both copies (``pack_weights(onednn=True, panels=True)``) keep ``kernel``'s:
    ``panels``, ``onednn``, or ``mixed`` (both, the panels up to ``panel_rows`` rows); the
    panels, what a decode step streams, then move onto huge pages."""
    kernels = [k for k in map(packed, linears(model)) if k is not None]
    for k in kernels:
        if kernel != "mixed":
            k.drop("onednn" if kernel == "panels" else "panels")
        elif k.panels is not None and k.onednn is not None:
            k.panel_rows = panel_rows
    hugepages.rehome(kernels, "panels")


@torch.inference_mode()
def time_linears(model: LlamaForCausalLM, rows: int, layers: int | None = None,
                 reps: int = 3) -> tuple[float, float]:
    """Seconds of one pass of ``rows`` rows through the linears of the first ``layers``
    layers (all, and the LM head, by default) via the panels and via oneDNN: the best of
    ``reps`` each, interleaved so both see the same machine. The rows are fp32, as the
    activations are on CPU whatever the weights."""
    mods = linears(model) if layers is None else [
        m for layer in model.layers[:layers] for m in layer.modules() if isinstance(m, Linear)]
    xs: list[tuple[PackedLinear, torch.Tensor | None, torch.Tensor]] = [
        (k, m.bias, torch.randn(rows, k.panels.shape[1], dtype=torch.float32)) for m in mods
        if (k := packed(m)) is not None and k.panels is not None]

    def run(panels: bool) -> float:
        t = time.perf_counter()
        for k, bias, x in xs:
            if panels:
                k.panel_forward(x, bias)
            else:
                k.onednn_forward(x, bias)
        return time.perf_counter() - t

    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, panels in enumerate((True, False)):
            best[i] = min(best[i], run(panels))
    return best[0], best[1]


# -- the choice --------------------------------------------------------------------------------
def choose_linear_kernel(model: LlamaForCausalLM, kernel: str,
                         prefill_rows: int = PREFILL_ROWS) -> str:
    """Pack the linears for ``kernel`` (CPU, fp32 or bf16 weights: the copies keep the
    weights' dtype) and return the one kept: ``panels`` (the native panel GEMM, every row
    count), ``onednn`` (oneDNN's prepacked linear), ``mixed``
    (panels up to ``MIXED_PANEL_ROWS`` rows, oneDNN above: two copies of the weights) or
    ``auto``: pack both and time them (:func:`_measure_linears`), keeping oneDNN's copy only
    where it wins. Kept per build, threads, token budget, shapes and dtype (:func:`save`)."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {'|'.join(LINEAR_KERNELS)}, "
                         f"got {kernel!r}")
    dtype = weight_dtype(model)
    have_panels, have_onednn = panels_available(dtype), onednn_packing_available(dtype)
    if kernel in ("panels", "mixed") and not have_panels:
        raise RuntimeError(f"linear_kernel={kernel}: the native panel GEMM is unavailable for "
                           f"{dtype} weights (it needs AVX2+FMA and a C compiler; see the log)")
    if kernel in ("onednn", "mixed") and not have_onednn:
        raise RuntimeError(f"linear_kernel={kernel}: this torch build cannot prepack {dtype} "
                           "weights for oneDNN on this CPU")
    if kernel == "auto" and not (have_panels and have_onednn):
        kernel = "panels" if have_panels else "onednn"
    panel_rows = MIXED_PANEL_ROWS
    if kernel == "auto":  # measured before for this build, thread count, shapes and dtype?
        prefill_rows = max(MIXED_PANEL_ROWS + 1, min(prefill_rows, PREFILL_ROWS))
        key = cache_key(linear_shapes(model), torch.get_num_threads(), prefill_rows, dtype)
        kept = load(key)
        if kept is not None:
            kernel, panel_rows = kept
            logger.info("linear kernels: %s (as measured before, cache key %s)", kernel, key)
    if kernel != "auto":
        pack_weights(model, onednn=kernel != "panels", panels=kernel != "onednn")
        keep_linear_kernel(model, kernel, panel_rows)
        return kernel
    pack_weights(model, onednn=True, panels=True)
    kernel, panel_rows, measured = _measure_linears(model, prefill_rows)
    keep_linear_kernel(model, kernel, panel_rows)
    save(key, kernel, panel_rows, measured)
    return kernel


def _measure_linears(model: LlamaForCausalLM, prefill_rows: int) -> tuple[str, int,
                                                                           dict[str, float]]:
    """``auto``: time a decode-sized pass (8 rows through every linear) both ways, then
    prefill-sized ones (128, 256, ... rows up to ``prefill_rows`` through the first layer),
    interleaved, and return the kernel to keep, the rows up to which ``mixed`` takes the panels
    and the times. Both copies only where oneDNN wins the larger passes by > 10% (a second copy
    of the weights for a clear win only: one layer is a short sample, and on a busy machine a
    few percent either way is noise); the panels keep every row count below the first such pass,
    decode steps included (their fused native layers need the panels). Which wins, and from
    which rows, depends on the CPU: on a Zen 3 the panels won every size by 1.1-1.3x; on a
    Cascade Lake Xeon oneDNN's lead grows with the rows (the tiny demo model's first layer:
    1.06x at 256 rows, 1.2x at 1024, 1.4x at 2048) while at 80 rows a decode step through
    the panels took 2/3 of one through oneDNN."""
    small = time_linears(model, 8)
    measured = {"panels_8": small[0] * 1e3, "onednn_8": small[1] * 1e3}
    if small[1] <= small[0]:
        kernel, panel_rows = "onednn", 0
    else:
        ladder = [r for r in (128, 256, 512, 1024, 2048) if r < prefill_rows] + [prefill_rows]
        wins: list[int] = []  # rows at which oneDNN won clearly, ascending
        for rows in ladder:
            p, o = time_linears(model, rows, layers=1, reps=3)
            measured[f"panels_{rows}"], measured[f"onednn_{rows}"] = p * 1e3, o * 1e3
            wins = wins + [rows] if p > 1.1 * o else []
            if len(wins) == 2:  # twice in a row: it only grows with the rows
                break
        if wins:
            kernel, panel_rows = "mixed", max(MIXED_PANEL_ROWS, wins[0] // 2)
        else:
            kernel, panel_rows = "panels", 0
    logger.info("linear kernels, panels vs oneDNN (ms): %s: keeping %s%s",
                ", ".join(f"{k.split('_')[1]} rows {measured[k]:.1f} vs "
                          f"{measured['onednn_' + k.split('_')[1]]:.1f}"
                          for k in measured if k.startswith("panels_")),
                kernel, f" (panels up to {panel_rows} rows)" if kernel == "mixed" else "")
    return kernel, panel_rows, measured
