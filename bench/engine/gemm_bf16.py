"""Paired microbenchmark of the panel GEMM over fp32 and bf16 weights, and torch's bf16 F.linear;
and of the native paged decode attention over an fp32 and a bf16 KV cache.

A decode step's linears at the ~150M demo model's shapes (``engine/demo_model.py``'s "base":
hidden 768, 12 heads over 4 KV heads of 64, inter 3072: qkv 768 -> 1280, o 768 -> 768, gate_up
768 -> 6144, down 3072 -> 768), one set per layer for ``--layers`` layers, so that at decode
sizes the weights stream from memory as they do in a step, not from cache. Per row count, the
variants run in a fresh random order each round (a shared host's memory bandwidth swings within
minutes: variants timed one after the other would compare phases, not code); printed are each
variant's median time per layer and its median ratio to the fp32 panels, round by round:

- ``fp32 panels``: ``gemm.panel_linear`` over fp32 panels (what an fp32 checkpoint runs);
- ``bf16 panels``: the same kernel over bf16 panels, widened in registers (half the bytes);
- ``torch bf16``: ``F.linear`` of bf16 rows (converted outside the timing) and bf16 weights,
  torch's own path (oneDNN where the CPU has bf16 support, else torch's fallback kernel).

With ``--attention``, the same pairing of ``attention.paged_decode`` over one fp32 and one bf16
copy of the same caches (the model's 12 heads of 64 over 4 KV heads, blocks of 16 in shuffled
order, ``--layers`` layers of cache so that it streams from memory), per batch x context.

    .venv/bin/python -m bench.engine.gemm_bf16 [--rows 1 8 32 512] [--seconds 10] [--attention]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvrelay.engine.cpu import attention, gemm
from kvrelay.engine.demo_model import DEMO_SIZES

BF16 = torch.bfloat16


def shapes(size: str) -> list[tuple[str, int, int]]:
    """(name, in, out) of one decoder layer's linears at a demo size (fused qkv, gate_up)."""
    s = DEMO_SIZES[size]
    hd = s.hidden_size // s.num_heads
    return [("qkv", s.hidden_size, (s.num_heads + 2 * s.num_kv_heads) * hd),
            ("o", s.hidden_size, s.hidden_size),
            ("gate_up", s.hidden_size, 2 * s.intermediate_size),
            ("down", s.intermediate_size, s.hidden_size)]


def make_variants(layers: list, x: dict[int, torch.Tensor], xb: dict[int, torch.Tensor],
                  nt: int, kb: int) -> dict[str, Callable[[], None]]:
    """Each variant as one call over every linear of ``layers``, rows ``x`` (``xb`` in bf16)."""

    def fp32() -> None:
        for layer in layers:
            for _, k, n, _w, p32, _pb in layer:
                gemm.panel_linear(x[k], p32, None, n, nt, kb)

    def bf16() -> None:
        for layer in layers:
            for _, k, n, _w, _p32, pb in layer:
                gemm.panel_linear(x[k], pb, None, n, nt, kb)

    def torch_bf16() -> None:
        for layer in layers:
            for _, k, _n, w, _p32, _pb in layer:
                F.linear(xb[k], w)

    return {"fp32 panels": fp32, "bf16 panels": bf16, "torch bf16": torch_bf16}


def paired(variants: dict[str, Callable[[], None]], seconds: float, rng: random.Random,
           per: int) -> dict[str, list[float]]:
    """Each variant's times (divided by ``per``), the variants in a fresh order each round."""
    for fn in variants.values():  # warm: page faults, oneDNN's primitive cache
        fn()
    times: dict[str, list[float]] = {v: [] for v in variants}
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(next(iter(times.values()))) < 3:
        for v in rng.sample(list(variants), len(variants)):
            t = time.perf_counter()
            variants[v]()
            times[v].append((time.perf_counter() - t) / per)
    return times


def decode_over(caches: list, which: int, q: torch.Tensor, tables: torch.Tensor,
                lens: torch.Tensor, bs: int) -> Callable[[], None]:
    """One decode attention call per layer's caches (``which``: the fp32 copy or the bf16)."""
    out = torch.empty_like(q)

    def run() -> None:
        for c in caches:
            k, v = c[which]
            attention.paged_decode(q, k, v, tables, lens, out, bs, 0.125, None)

    return run


def bench_attention(args: argparse.Namespace, rng: random.Random) -> None:
    s = DEMO_SIZES[args.size]
    heads, kvh, d, bs = s.num_heads, s.num_kv_heads, s.hidden_size // s.num_heads, 16
    for batch, ctx in ((1, 2048), (8, 512), (8, 2048), (32, 1024)):
        nblk = batch * -(-ctx // bs)
        perm = torch.randperm(nblk, generator=torch.Generator().manual_seed(batch + ctx))
        tables = perm.view(batch, -1).to(torch.int32).contiguous()
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        caches = []
        for _ in range(args.layers):
            kc, vc = torch.randn(nblk * bs, kvh, d), torch.randn(nblk * bs, kvh, d)
            caches.append(((kc, vc), (kc.to(BF16), vc.to(BF16))))
        q = torch.randn(batch, heads, d)
        times = paired({"fp32 cache": decode_over(caches, 0, q, tables, lens, bs),
                        "bf16 cache": decode_over(caches, 1, q, tables, lens, bs)},
                       args.seconds, rng, len(caches))
        ref = times["fp32 cache"]
        kv_elems = 2 * batch * ctx * kvh * d
        print(f"decode attention, batch {batch} x {ctx} keys: {len(ref)} rounds of "
              f"{len(caches)} layers; per layer:")
        for v, ts in times.items():
            med = statistics.median(ts)
            speed = statistics.median(a / b for a, b in zip(ref, ts, strict=True))
            esz = 4 if v == "fp32 cache" else 2
            print(f"  {v:12s} {med * 1e3:8.3f} ms  {speed:5.2f}x  "
                  f"({kv_elems * esz / med / 1e9:5.1f} GB/s of KV)")
        del caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="base", choices=sorted(DEMO_SIZES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--layers", type=int, default=12,
                    help="layers of weights at decode sizes (fewer past 64 rows: compute-bound)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per row count")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--attention", action="store_true",
                    help="pair the paged decode attention over fp32 and bf16 caches too")
    args = ap.parse_args()
    if not gemm.available():
        raise SystemExit("needs the native panel GEMM")
    torch.set_num_threads(args.threads)
    kb, nt = gemm.default_kblock(), args.threads
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layer = []
        for name, k, n in shapes(args.size):
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(BF16)
            layer.append((name, k, n, w, gemm.pack_panels(w.float(), kb), gemm.pack_panels(w, kb)))
        layers.append(layer)
    rng = random.Random(0)
    wbytes = sum(n * k for _, k, n, *_ in layers[0])  # elements per layer
    print(f"{args.size}: {len(layers[0])} linears, {wbytes / 1e6:.2f}M weights a layer; "
          f"{nt} threads, K blocks of {kb or 'K'}; torch {torch.__version__}, bf16 oneDNN "
          f"{'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'}")
    for m in args.rows:
        use = layers if m <= 64 else layers[:2]
        x = {k: torch.randn(m, k, generator=g) for k in {k for _, k, *_ in layers[0]}}
        xb = {k: v.to(BF16) for k, v in x.items()}
        times = paired(make_variants(use, x, xb, nt, kb), args.seconds, rng, len(use))
        ref = times["fp32 panels"]
        print(f"M = {m}: {len(ref)} rounds of {len(use)} layers; per layer, and the ratio of "
              f"fp32 panels' time to each (round by round, median):")
        for v, ts in times.items():
            med = statistics.median(ts)
            speed = statistics.median(a / b for a, b in zip(ref, ts, strict=True))
            esz = 4 if v == "fp32 panels" else 2
            print(f"  {v:12s} {med * 1e3:8.3f} ms  {speed:5.2f}x  "
                  f"({wbytes * esz / med / 1e9:5.1f} GB/s of weights, "
                  f"{2 * m * wbytes / med / 1e9:6.1f} GFLOP/s)")
    if args.attention:
        bench_attention(args, rng)


if __name__ == "__main__":
    main()
