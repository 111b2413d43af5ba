"""The warm-up probe: policies that measure workers before routing to them (``auto``).

A joining prefill or decode worker is held out of routing (``Accounting.calibrating``) while the
router runs synthetic prompts through it the way live requests run: its engine fits its step
time on them and reports the fit in its beats (the cost model's per-worker parameters), and the
router measures the RPCs and the KV transfer. A worker not measured in time serves on its
peers' fit (or the priors) until its own beats carry one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time

import grpc

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.router.errors import RouterError
from kvrelay.router.lifecycle import Lifecycle
from kvrelay.router.policy import RouteRequest
from kvrelay.router.requests import GenerateSpec, Pass, WorkerLost
from kvrelay.router.trace import Trace
from kvrelay.router.worker_state import WorkerState

logger = logging.getLogger(__name__)

# Rounds of six probe prompts at most: the engine fits after 16 steps (engine/step_cost.py), a
# decode worker's probe takes two steps, a prefill worker's one.
MAX_PROBE_ROUNDS = 4


class Calibrator:
    """Measures each worker that joins ``lifecycle``'s registry, one at a time."""

    def __init__(self, lifecycle: Lifecycle):
        self.lc = lifecycle
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        lifecycle.registry.on_join = self.on_join

    def on_join(self, w: WorkerState) -> None:
        if w.identity.role not in ("prefill", "decode"):
            w.accounting.calibrating = False
            return
        task = asyncio.get_running_loop().create_task(self._calibrate(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _calibrate(self, w: WorkerState) -> None:
        """Measure a joining worker before it takes traffic (see ``_probe``). Bounded; a worker
        not measured in time serves on the priors and is measured by live requests."""
        t0 = time.monotonic()
        limit = self.lc.config.calibration_timeout_s
        try:
            if w.identity.role == "prefill":  # a prefill needs somewhere to send its KV
                while not self.lc.registry.alive("decode"):
                    if time.monotonic() - t0 > limit:
                        raise TimeoutError("no decode worker to send probe KV to")
                    await asyncio.sleep(0.05)
            async with self._lock:  # one worker at a time: probes would share the cores
                await asyncio.wait_for(self._probe(w), limit)
            fit = w.perf.step_cost
            assert fit is not None
            logger.info("calibrated %s in %.2fs: step %.2fms + %.4fms/prompt token + "
                        "%.4fms/decode (%d steps)", w.worker_id, time.monotonic() - t0,
                        fit.base * 1e3, fit.prefill_token * 1e3, fit.decode * 1e3,
                        fit.samples)
        except (TimeoutError, WorkerLost, RouterError, grpc.aio.AioRpcError,
                grpc.aio.UsageError) as e:
            logger.warning("calibration of %s incomplete (%s): routing to it on priors",
                           w.worker_id, e or type(e).__name__)
        finally:
            w.accounting.calibrating = False
            self.lc.registry.notify()

    async def _probe(self, w: WorkerState) -> None:
        """Synthetic prompts of several sizes, run on ``w`` the way live requests run (a prefill
        worker's with KV sent to a decode worker, a decode worker's wholly there), round after
        round until its beats carry its engine's step-time fit. The first two warm it up and
        are not recorded (the router's RPC and transfer measurements)."""
        bs = w.identity.block_size
        large = max(2 * bs, min(32 * bs, w.identity.max_model_len // 4 // bs * bs))
        warm = (bs, large)
        sizes = [n for n in (bs, 8 * bs, large) if n <= large for _ in range(2)]
        rng = random.Random()
        i = 0
        for round_ in range(MAX_PROBE_ROUNDS):
            for n in (*warm, *sizes) if round_ == 0 else sizes:
                await self._run_one(w, [rng.randrange(256) for _ in range(n)],  # no cache hits
                                    record=i >= len(warm))
                i += 1
            if await self._fit_reported(w):
                return
        raise TimeoutError(f"no step-time fit in its beats after {i} probes")

    async def _run_one(self, w: WorkerState, prompt: list[int], *, record: bool) -> None:
        role = w.identity.role
        sampling = SamplingParams(max_tokens=2 if role == "decode" else 1, temperature=0.0,
                                  ignore_eos=True)
        spec = GenerateSpec(f"calibrate-{w.worker_id}-{secrets.token_hex(4)}", prompt, sampling)
        ctx = Pass(RouteRequest(prompt, sampling.max_tokens), reason="calibration",
                   record=record, count=False)
        trace = Trace()
        if role == "decode":
            gen = self.lc.local_pass(spec, prompt, sampling, trace, w, ctx)
        else:
            ctx.prefill = w
            gen = self.lc.disaggregated_pass(spec, prompt, sampling, trace, ctx)
        async with contextlib.aclosing(gen) as chunks:
            async for _ in chunks:
                pass

    async def _fit_reported(self, w: WorkerState) -> bool:
        """Whether ``w``'s beats carry a step-time fit, waiting up to two beats for one."""
        if w.perf.step_cost is None:
            with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from 3.11 on
                await asyncio.wait_for(w.perf.fit_reported.wait(),
                                       2.0 * self.lc.registry.heartbeat_interval_s)
        return w.perf.step_cost is not None
