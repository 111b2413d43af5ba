"""engine.cpu.thread_pinning: a serving engine's OpenMP threads, one per CPU, and when."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvrelay.engine.cpu import native
from kvrelay.engine.cpu.thread_pinning import plan


def test_plan_pins_only_an_engine_that_owns_its_cpus() -> None:
    assert plan("auto", 2, {3, 1}) == [1, 3]  # the calling (engine) thread first
    assert plan("auto", 2, {0, 1, 2, 3}) is None  # other work may need the other CPUs
    assert plan("on", 2, {5, 0, 1, 2}) == [0, 1]
    assert plan("on", 4, {0, 1}) is None  # never two of its threads on one CPU
    assert plan("off", 2, {0, 1}) is None
    assert plan("auto", 1, {0}) is None  # one thread: nothing to keep apart
    with pytest.raises(ValueError, match="thread binding"):
        plan("sometimes", 2, {0, 1})


# In a fresh interpreter restricted to two CPUs: an AsyncEngine pins its thread and its OpenMP
# worker per the mode; the pinning holds through later torch and native parallel regions (the
# same pooled threads run them: pinning again finds the same thread ids).
_PROBE = """
import asyncio, ctypes, json, os, sys, threading
cpus = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, cpus)
import torch
from kvrelay.engine.cpu import native
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams

async def main():
    build = lambda: EngineCore(EngineConfig.from_kwargs(
        sys.argv[1], num_blocks=64, num_threads=2, thread_binding=sys.argv[2]))
    engine = await AsyncEngine.spawn(build)
    try:
        outs = [o async for o in engine.generate("r", list(range(5, 70)), SamplingParams(
            max_tokens=4, ignore_eos=True))]
        assert outs[-1].finished
        def again():
            lib = native.load()
            arr = (ctypes.c_int32 * 2)(*cpus)
            tids = (ctypes.c_int64 * 2)()
            lib.kvr_pin_threads(arr, 2, tids)
            return [threading.get_native_id(), list(tids)]
        me, tids = await engine.call(again)
        pinned = {str(t): c for t, c in engine.pinned.items()}
        print(json.dumps({"cpus": cpus, "pinned": pinned, "engine_tid": me, "again": tids,
                          "affinity": {t: sorted(os.sched_getaffinity(int(t))) for t in pinned}}))
    finally:
        engine.shutdown()

asyncio.run(main())
"""


def probe(model_dir: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, model_dir, mode], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not native.available(),
                               reason="needs two CPUs and the native kernels")


@needs_two
def test_a_serving_engine_on_its_own_two_cpus_pins_one_thread_to_each(demo_model_dir) -> None:
    got = probe(demo_model_dir, "auto")
    cpus = got["cpus"]
    assert sorted(got["pinned"].values()) == cpus
    assert got["pinned"][str(got["engine_tid"])] == cpus[0]  # the thread that steps the engine
    assert got["affinity"] == {t: [c] for t, c in got["pinned"].items()}
    # the same two threads, in the same order, after the steps' torch and native regions
    assert [str(t) for t in got["again"]] == list(got["pinned"])


@needs_two
def test_off_leaves_placement_to_the_os(demo_model_dir) -> None:
    assert probe(demo_model_dir, "off")["pinned"] == {}


def test_the_worker_option_reaches_the_engine_config() -> None:
    import argparse

    from kvrelay.common.options import add_engine_options, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_options(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--thread-binding", "off"]))
    assert cfg.model.thread_binding == "off"
    assert engine_config_from_args(p.parse_args(["--model", "m"])).model.thread_binding == "auto"
    with pytest.raises(ValueError, match="thread_binding"):
        from kvrelay.engine.config import ModelConfig

        ModelConfig(model="m", thread_binding="always")
