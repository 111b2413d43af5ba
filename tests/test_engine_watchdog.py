"""The engine watchdog: a stuck engine step turns the worker's readiness (gRPC health) off and
is reported (log, ``kvrelay:engine_stuck`` / ``kvrelay:engine_stalls``); readiness comes back
when the step ends."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.worker.process import Worker
from kvrelay.worker.settings import WorkerSettings
from kvrelay.worker.watchdog import EngineWatchdog, WatchdogConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_watchdog_flips_on_a_long_step_and_back_when_it_ends(caplog) -> None:
    now = [0.0]
    since: list[float | None] = [None]
    changes: list[bool] = []
    wd = EngineWatchdog(lambda: since[0], WatchdogConfig(limit_s=2.0), changes.append,
                        clock=lambda: now[0])
    assert not wd.check()
    since[0] = 0.0
    now[0] = 1.9
    assert not wd.check()  # a long step, not yet a stuck one
    now[0] = 2.5
    with caplog.at_level(logging.ERROR, logger="kvrelay.worker.watchdog"):
        assert wd.check() and wd.check()
    assert "stuck" in caplog.text
    since[0] = None  # the step ended
    assert not wd.check()
    assert changes == [True, False] and wd.num_stalls == 1


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="positive"):
        WatchdogConfig(limit_s=0)
    with pytest.raises(ValueError, match="--engine-watchdog"):
        WorkerSettings(role="both", engine_watchdog_s=-1.0)


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        return resp.status


async def _until(port: int, status: int, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while await _health(port) != status:
        assert time.monotonic() - t0 < timeout, f"health never became {status}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_a_wedged_engine_step_turns_readiness_off_until_it_ends(demo_model_dir) -> None:
    config = EngineConfig.from_kwargs(demo_model_dir, num_blocks=64, num_threads=1)
    settings = WorkerSettings(role="both", engine_watchdog_s=0.3, metrics_port=0)

    async def scenario() -> None:
        worker = Worker(settings, config)
        await worker.start()
        try:
            assert await _health(worker.port) == SERVING
            release = threading.Event()
            step = worker.engine.core.step

            def wedged_step():  # the first step hangs until released
                release.wait(30)
                return step()

            worker.engine.core.step = wedged_step
            sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

            async def run() -> list[int]:
                out = []
                async for o in worker.engine.generate("wd-1", [5, 6, 7, 8], sp):
                    out += o.new_token_ids
                return out

            task = asyncio.get_running_loop().create_task(run())
            await _until(worker.port, NOT_SERVING)
            assert worker.watchdog is not None and worker.watchdog.stuck
            assert worker.metrics.engine_stuck._value.get() == 1
            assert worker.metrics.engine_stalls._value.get() == 1
            assert worker._load().draining  # routers send it nothing new meanwhile
            release.set()
            await _until(worker.port, SERVING)
            assert worker.metrics.engine_stuck._value.get() == 0
            assert not worker._load().draining
            assert len(await asyncio.wait_for(task, 30)) == 4  # the step finished its work
        finally:
            await worker.stop()

    asyncio.run(scenario())
