"""KV bytes per token and P -> D handoff time, multi-head latent attention vs per-head K/V.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.mla_kv [--reps 5] [--prompt 1024]

Three layer shapes of DeepSeek-V3's width (hidden 7168, 128 query heads), bf16, ``--layers``
layers, a prompt handed from a prefill-side connector to a decode-side one in another process
(NIXL over UCX), the engine's path (512-token chunks, each step's writes posted as it ends, then
the notification), as ``swa_handoff`` does (``rig.handoff_row``):

  - MLA: DeepSeek-V3's latent cache, one plane of 512 + 64 per token per layer;
  - GQA: the same width with 8 KV heads of 128 (the usual dense model of that width), K and V;
  - MHA: V3's 128 heads of 128 uncompressed, K and V (what MLA replaces).

Columns: bytes a handoff moved (counted from the transport's writes), KiB per token (all
layers), the share of the GQA row's, and the median milliseconds per 1K prompt tokens from the
first chunk to the notification. Times move with the shared machine's load (printed).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from bench.transfer.rig import handoff_row, print_handoff_rows
from kvrelay.engine.kv_cache import KVCacheSpec

BS = 16
# label -> (KV heads, head dim, planes) of one layer's cache
SHAPES = {
    "MLA (DeepSeek-V3: latent 512 + rope 64)": (1, 576, 1),
    "GQA (8 KV heads x 128, same width)": (8, 128, 2),
    "MHA (128 heads x 128, uncompressed)": (128, 128, 2),
}


def spec_of(shape: tuple[int, int, int], layers: int, prompt: int) -> KVCacheSpec:
    heads, dim, planes = shape
    return KVCacheSpec(layers, heads, dim, BS, prompt // BS + 4, "bfloat16", planes=planes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=1024, help="tokens (a multiple of 16)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for label, shape in SHAPES.items():
        spec = spec_of(shape, args.layers, args.prompt)
        nbytes, t = handoff_row(label, spec, args.prompt, args.reps)
        per_token = spec.bytes_per_block_all_layers // BS
        assert nbytes == per_token * args.prompt, (label, nbytes, per_token)
        rows.append((label, nbytes, t))
    print(f"\nKV handoff P -> D: {args.layers} layers of DeepSeek-V3's width, bf16, prompt "
          f"{args.prompt} tokens, median of {args.reps}, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print_handoff_rows(rows, args.prompt, "layer cache", "GQA", rows[1][1])
    print("\nper token per layer (bytes, bf16): " + ", ".join(
        f"{label.split(' (')[0]} {spec_of(s, 1, BS).bytes_per_block_all_layers // BS}"
        for label, s in SHAPES.items()))


if __name__ == "__main__":
    main()
