"""``bench/engine/throughput.py --tp N``: a 2048-token prefill of a TP=N replica (one thread per
rank)
against TP=1 with one and with N threads, in one run, and the share of rank 0's step spent in
all-reduces (waiting for the slower rank included): where tensor parallelism pays on CPU.
"""

from __future__ import annotations

import os
import time

import torch

from bench.engine.core_runs import make_core, prompt, run_prefill

_seeds = iter(range(2 * 10**9, 3 * 10**9))


class _TimedShard:
    """A rank's shard whose all-reduces are timed (the bench's view of the TP step)."""

    def __init__(self, shard: object):
        self.shard, self.seconds = shard, 0.0

    def all_reduce(self, t: torch.Tensor, *args: object) -> None:
        start = time.perf_counter()
        self.shard.all_reduce(t, *args)  # type: ignore[attr-defined]
        self.seconds += time.perf_counter() - start


def tp_bench(model_dir: str, tp: int, reps: int, n: int = 2048) -> int:
    """Prefill of one ``n``-token prompt: TP=``tp`` with one thread per rank against TP=1 with
    one and with ``tp`` threads, and the share of the TP step rank 0 spends in all-reduces
    (waiting for the slower rank included)."""
    from kvrelay.engine.tp_shard import RowParallelLinear

    print(f"prefill {n} tokens, best of {reps}; load average {os.getloadavg()[0]:.2f}")
    blocks = n // 16 + 64
    for label, threads, size in ((f"TP={tp}, 1 thread/rank", 1, tp), ("TP=1, 1 thread", 1, 1),
                                 (f"TP=1, {tp} threads", tp, 1)):
        core = make_core(model_dir, threads, num_blocks=blocks, tensor_parallel_size=size)
        vocab = core.runner.arch.vocab_size
        timed = None
        if size > 1:
            row = [m for m in core.runner.model.modules() if isinstance(m, RowParallelLinear)]
            timed = _TimedShard(row[0].shard)
            for m in row:
                m.shard = timed  # type: ignore[assignment]
        run_prefill(core, [prompt(n, next(_seeds), vocab)])
        best_t, share = float("inf"), 0.0
        for _ in range(reps):
            if timed is not None:
                timed.seconds = 0.0
            t = run_prefill(core, [prompt(n, next(_seeds), vocab)])
            if t < best_t:
                best_t, share = t, (timed.seconds / t if timed is not None else 0.0)
        extra = f"; all-reduce {share:.1%} of the step" if timed is not None else ""
        print(f"{label:>22}: {n / best_t:8.0f} tok/s ({best_t * 1e3:.0f} ms){extra}", flush=True)
        if size > 1:
            core.runner.close()  # type: ignore[attr-defined]
    return 0
