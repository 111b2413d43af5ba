"""What the KV transfer benchmarks share: the payload's KV shape, the median timer, and a
receiving process's answer loop (it keeps its agents progressing and checksums blocks)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvrelay.engine.kv_cache import KVCacheSpec

MiB = 1 << 20
# 64 KiB blocks (16 tokens x 8 KV heads x 128 dims x fp32); 2 layers x 2 x 2048 blocks = 512 MiB
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2048)
MODEL_ID = "bench-model"


def time_median(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn``, after one warm-up call (first touch,
    connection set-up)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def answer_sums(conn: Connection, agents: Sequence[Any], kvs: Sequence[torch.Tensor]) -> None:
    """A receiver's loop: keep its agents progressing (a sender's first write waits on the
    connection handshake) and answer each list of blocks with their sum over ``kvs``, until
    "exit"."""
    while True:
        while not conn.poll(0.002):
            for a in agents:
                a.progress()
        cmd = conn.recv()
        if cmd == "exit":
            return
        conn.send(sum(kv[:, :, cmd].double().sum().item() for kv in kvs))
