"""The heap trimmer (glibc's malloc_trim after prefill work, at most once per interval) and the
cap on oneDNN's primitive caches."""

from __future__ import annotations

import os
import platform

import pytest

from kvrelay.engine.heap import (
    ONEDNN_CACHE_VARS,
    HeapTrimmer,
    bound_onednn_caches,
    libc_malloc_trim,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_trims_only_after_prefill_and_once_per_interval() -> None:
    clock, calls = Clock(), []
    h = HeapTrimmer(interval_s=2.0, clock=clock, trim=lambda pad: calls.append(pad) or 1)
    clock.t += 5
    assert not h.after_step(0)  # decode-only steps leave the heap alone
    assert h.after_step(512) and calls == [0]
    clock.t += 1
    assert not h.after_step(512)  # within the interval: pending
    clock.t += 1.5
    assert h.after_step(0) and calls == [0, 0]  # the pending tokens trim once it is due
    assert h.num_trims == 2
    clock.t += 10
    assert not h.after_step(0)  # nothing pending since
    assert h.num_trims == 2


def test_without_glibc_it_does_nothing() -> None:
    h = HeapTrimmer(interval_s=0.0)
    h._trim = None
    assert not h.available and not h.after_step(10_000) and h.num_trims == 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_engine_trims_through_glibc(hf_model_dir) -> None:
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.sampling_params import SamplingParams

    assert libc_malloc_trim() is not None
    core = EngineCore(EngineConfig.from_kwargs(hf_model_dir("llama"), num_blocks=64))
    assert core.heap.available
    core.heap.interval_s = 0.0
    core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=3, temperature=0))
    while core.has_unfinished():
        core.step()
    assert core.heap.num_trims == 1  # the prefill step; the decode steps add none


_GROWTH_SCRIPT = """
import os, sys
import torch
from kvrelay.engine.heap import bound_onednn_caches
if sys.argv[1] == "bounded":
    bound_onednn_caches(8)  # after import torch, before the first oneDNN op
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1024, 256), None)
x = torch.randn(200, 256)
for m in (1, 2, 3):
    torch.ops.mkldnn._linear_pointwise(x[:m], w, None, "none", [], "")
before = rss()
for m in range(4, 164):  # 160 row counts: one primitive each
    torch.ops.mkldnn._linear_pointwise(x[:m], w, None, "none", [], "")
print(rss() - before)
"""


def test_bounded_onednn_caches_stop_growth_per_row_count(tmp_path) -> None:
    """Every new row count compiles a oneDNN primitive (~0.6 MiB); capped caches drop the old
    ones instead of keeping up to 1024 of each."""
    import subprocess
    import sys

    from kvrelay.engine.models.llama import onednn_packing_available

    if not onednn_packing_available():
        pytest.skip("no oneDNN in this torch build")
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARS}
    growth = {}
    for mode in ("default", "bounded"):
        out = subprocess.run([sys.executable, "-c", _GROWTH_SCRIPT, mode], env=env,
                             capture_output=True, text=True, check=True, timeout=120)
        growth[mode] = float(out.stdout.split()[-1])
    assert growth["bounded"] < 0.3 * growth["default"], growth


def test_bound_respects_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "4096")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_onednn_caches(32) == {"LRU_CACHE_CAPACITY": "4096",
                                       "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32"}
