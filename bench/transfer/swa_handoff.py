"""Benchmark the KV handoff of sliding-window hybrids: the bytes and time of a prompt's handoff
through the connectors (the engine's path), dense GQA against Gemma 3's 5:1 hybrid and an
all-windowed model.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.swa_handoff [--reps 7]

(also ``python -m bench.transfer.kv_transfer --swa``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from bench.transfer.rig import handoff_row, print_handoff_rows
from kvrelay.engine.kv_cache import KVCacheSpec

# -- sliding-window hybrids (``--swa``): bytes and time of a prompt's handoff ------------------
# A Gemma-3-4B-like layer (4 KV heads x 256, bf16: 4 KiB of K and V per token), 12 layers (5
# local : 1 global, window 1024, as Gemma 3), a prompt of 4x the window handed over whole.
SWA_WINDOW, SWA_PROMPT, SWA_LAYERS, SWA_BS = 1024, 4096, 12, 16
SWA_SHAPES = {
    "dense GQA (every layer global)": (None,) * SWA_LAYERS,
    "Gemma 3 hybrid 5:1": tuple(None if (i + 1) % 6 == 0 else SWA_WINDOW
                                for i in range(SWA_LAYERS)),
    "all windowed (Mistral-style)": (SWA_WINDOW,) * SWA_LAYERS,
}


def _swa_spec(windows: tuple[int | None, ...]) -> KVCacheSpec:
    blocks = SWA_PROMPT // SWA_BS + 16
    return KVCacheSpec(SWA_LAYERS, 4, 256, SWA_BS, blocks, "bfloat16", layer_windows=windows)


def swa_rows(reps: int) -> list[tuple[str, int, float]]:
    """Each shape's prompt handed to a decode worker through the connectors (the engine's
    path, ``rig.handoff_row``: 512-token chunks, each step's writes posted as the step ends):
    (shape, bytes moved, median seconds from the first chunk to the notification). Printed as a
    table."""
    rows = []
    for label, windows in SWA_SHAPES.items():
        nbytes, t = handoff_row(label, _swa_spec(windows), SWA_PROMPT, reps)
        rows.append((label, nbytes, t))
    print(f"\nsliding-window KV handoff: {SWA_LAYERS} layers x 4 KV heads x 256 bf16, window "
          f"{SWA_WINDOW}, prompt {SWA_PROMPT} tokens, median of {reps}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print_handoff_rows(rows, SWA_PROMPT, "model", "dense", rows[0][1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    swa_rows(args.reps)


if __name__ == "__main__":
    main()
