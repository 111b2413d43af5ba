"""The warm-up probe: policies that measure workers before routing to them (``auto``).

A joining prefill or decode worker is held out of routing (``Accounting.calibrating``) while the
router runs synthetic prompts through it the way live requests run, feeding the cost model's
fits; a worker not measured in time serves on the priors and live requests measure it.
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
            fit = w.perf.prefill_fit if w.identity.role == "prefill" else w.perf.local_fit
            a, b = fit.coef()
            logger.info("calibrated %s in %.2fs: first token %.1fms + %.3fms/token", w.worker_id,
                        time.monotonic() - t0, a * 1e3, b * 1e3)
        except (TimeoutError, WorkerLost, RouterError, grpc.aio.AioRpcError,
                grpc.aio.UsageError) as e:
            logger.warning("calibration of %s incomplete (%s): routing to it on priors",
                           w.worker_id, e or type(e).__name__)
        finally:
            w.accounting.calibrating = False
            self.lc.registry.notify()

    async def _probe(self, w: WorkerState) -> None:
        """Synthetic prompts of several sizes, run on ``w`` the way live requests run (a prefill
        worker's with KV sent to a decode worker, a decode worker's wholly there), so the same
        observations feed the RPC, transfer and decode-step measurements. The first two warm it
        up and are not recorded. Its compute fit gets the fastest of the repeats of each size:
        another process starting up at the same moment (workers join together) can only add
        time, and a pessimistic fit would keep the fast lane from ever measuring it again."""
        role, bs = w.identity.role, w.identity.block_size
        large = max(2 * bs, min(32 * bs, w.identity.max_model_len // 4 // bs * bs))
        warm = (bs, large)
        sizes = [n for n in (bs, 8 * bs, large) if n <= large for _ in range(2)]
        best: dict[int, tuple[float, int]] = {}  # size -> (seconds, tokens computed)
        rng = random.Random()
        for i, n in enumerate((*warm, *sizes)):
            rid = f"calibrate-{w.worker_id}-{i}-{secrets.token_hex(4)}"
            prompt = [rng.randrange(256) for _ in range(n)]  # fresh: no cache hits
            sampling = SamplingParams(max_tokens=2 if role == "decode" else 1,
                                      temperature=0.0, ignore_eos=True)
            spec = GenerateSpec(rid, prompt, sampling)
            ctx = Pass(RouteRequest(prompt, sampling.max_tokens), reason="calibration",
                        record=i >= len(warm), fit=False, count=False)
            trace = Trace()
            if role == "decode":
                gen = self.lc.local_pass(spec, prompt, sampling, trace, w, ctx)
            else:
                ctx.prefill = w
                gen = self.lc.disaggregated_pass(spec, prompt, sampling, trace, ctx)
            t0, first = time.monotonic(), None
            async with contextlib.aclosing(gen) as chunks:
                async for chunk in chunks:
                    if first is None:
                        first = (time.monotonic() - t0, n - chunk.cached_prompt_tokens)
            if ctx.record and first is not None:
                if role == "prefill" and trace.prefill is not None:
                    first = (trace.prefill.prefill_ms / 1e3,
                             n - trace.prefill.cached_prompt_tokens)
                best[n] = min(best.get(n, first), first)
        fit = w.perf.prefill_fit if role == "prefill" else w.perf.local_fit
        for seconds, computed in best.values():
            fit.observe(computed, seconds)
