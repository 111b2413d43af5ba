"""bench/engine/throughput.py, the engine's roofline benchmark, runs end to end on the tiny demo
model and prints every row with its share of the roofline."""

from __future__ import annotations

import re

import pytest

from kvrelay.engine.cpu import gemm, prefetch_tuner


@pytest.mark.slow
def test_the_roofline_benchmark_prints_every_row(demo_model_dir, capsys) -> None:
    # One thread: `make test` keeps both cores busy (94 % over a run), and beside a process
    # holding a core this run took 24 s on one thread against 31 s on two (17 s on two when
    # the host is idle). In this process: a fresh one spent ~5 s of ~22 importing torch and
    # transformers. The GEMM tuning, which the online prefetch tuner may move between steps
    # (AVX-512), and the thread count are put back after.
    import torch

    from bench.engine import throughput

    before, threads = (gemm.tuning() if gemm.available() else None), torch.get_num_threads()
    try:
        assert throughput.main(["--model", str(demo_model_dir), "--skip-hf", "--reps", "1",
                                "--quick", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
        if before is not None:
            gemm.tuning(before)
    out = capsys.readouterr().out
    shares = {}
    for line in out.splitlines():
        m = re.match(r"\s*(.+?)\s+[\d.]+\s+[\d.]+\s+(\d+)%", line)
        if m:
            shares[m.group(1)] = int(m.group(2))
    for row in ("128", "512", "2048", "8 x 256", "2048 (1536 cached)", "1", "8", "32",
                "8 ctx 64-256", "32 ctx 64-256", "64 ctx 64-256"):
        assert 0 < shares[row] < 200, (row, out)
    tuned = prefetch_tuner.applies()
    assert ("next-panel prefetch after" in out) == tuned
    if tuned:  # the batch-8 rows were probed
        m = re.search(r"prefetch after (\d+) probes: on at batch (.*); off at (.*)\)", out)
        assert m and int(m.group(1)) > 0
        assert "8" in (m.group(2) + ", " + m.group(3)).split(", ")
