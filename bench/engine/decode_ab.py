"""Paired A/B of decode steps: the panels on huge or small pages x the GEMM's k-major rows on or
off, interleaved step by step in one process.

The memory bandwidth of a shared host swings by 2x within minutes, so variants timed one after
the other compare phases, not code. Here one engine keeps both placements of its panels (the
huge-page arena it loaded and a plain copy) and switches between the four variants before every
step, in a fresh random order each round, on the same running batch; each variant's median and
its median ratio to the first variant over all steps are printed.

    .venv/bin/python -m bench.engine.decode_ab --model /path/to/base150 --batch 8 --seconds 120
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

import torch

from kvrelay.engine.cpu import gemm, hugepages, packed_linear
from kvrelay.engine.cpu.packed_linear import packed
from kvrelay.engine.llm import LLM
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.sampling_params import SamplingParams

VARIANTS = {"small-pages/in-place": ("small", 0), "small-pages/k-major": ("small", 1024),
            "huge-pages/in-place": ("huge", 0), "huge-pages/k-major": ("huge", 1024)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30, help="steps per round (one batch)")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    args = ap.parse_args(argv)
    # Its probes would run steps of every variant on the other prefetch arm.
    os.environ["KVRELAY_GEMM_AUTOTUNE"] = "0"
    if not gemm.available() or not hugepages.enabled():
        raise SystemExit("needs the panel GEMM and MADV_HUGEPAGE")
    # The k-major choice applies to panels in one K block: weights in K blocks (this CPU's
    # default where gemm.default_kblock() > 0) run block by block whatever it says.
    packed_linear.default_kblock = lambda: 0
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, num_threads=args.threads,
              linear_kernel="panels")
    core, model = llm.engine, llm.engine.runner.model
    fused = model.fused_decode
    lins = [k for m in model.modules()
            if isinstance(m, Linear) and (k := packed(m)) is not None and k.panels is not None]
    panels = {"huge": [lin.panels for lin in lins]}
    panels["small"] = [p.clone() for p in panels["huge"]]
    base = gemm.tuning()
    layers: dict[str, object] = {}
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)

    def place(pages: str) -> None:
        for lin, p in zip(lins, panels[pages], strict=True):
            lin.panels = p
        if fused is not None:  # its layer structs point at the panels: one set per placement
            fused._layers = layers.get(pages)

    def start_batch() -> None:
        for i in range(args.batch):
            core.add_request(f"ab{rng.random()}-{i}", [rng.randrange(10, 3000) for _ in range(64)],
                             sp)
        while any(s.num_uncomputed_tokens > 1 for s in core.scheduler.running) \
                or core.scheduler.waiting:
            core.step()

    def end_batch() -> None:
        for rid in [s.request_id for s in core.scheduler.running]:
            core.abort(rid)
        while core.has_unfinished():
            core.step()

    for pages in panels:  # build each placement's fused structs once
        place(pages)
        start_batch()
        core.step()
        if fused is not None:
            layers[pages] = fused._layers
        end_batch()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end:
            start_batch()
            for _ in range(args.steps):
                for v in rng.sample(list(VARIANTS), len(VARIANTS)):
                    pages, pack = VARIANTS[v]
                    place(pages)
                    gemm.tuning(dataclasses.replace(base, pack_min_k=pack))
                    t = time.perf_counter()
                    core.step()
                    times[v].append(time.perf_counter() - t)
            end_batch()
    finally:
        gemm.tuning(base)
    ref = next(iter(VARIANTS))
    print(f"batch {args.batch}, {len(times[ref])} steps a variant, {torch.get_num_threads()} "
          f"threads; step time and its ratio to {ref}, step by step:")
    for v, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, times[ref], strict=True))
        print(f"  {v:22s} {statistics.median(ts) * 1e3:7.2f} ms  {ratio:.3f}x")


if __name__ == "__main__":
    main()
