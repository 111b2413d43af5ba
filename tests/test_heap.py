"""The heap trimmer: glibc's malloc_trim after prefill work, at most once per interval."""

from __future__ import annotations

import platform

import pytest

from kvrelay.engine.heap import HeapTrimmer, libc_malloc_trim


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
