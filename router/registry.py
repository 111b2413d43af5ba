"""Workers the router knows of, fed by heartbeats; a worker that misses them is taken out.

The registry also keeps the router's own view of work it has handed out since the last beat
(prompt tokens sent to a prefill worker, blocks reserved on a decode worker), so a burst of
requests between two beats does not all land on the same worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.rpc import insecure_channel

logger = logging.getLogger(__name__)

ROLE_NAMES = {wpb.ROLE_PREFILL: "prefill", wpb.ROLE_DECODE: "decode", wpb.ROLE_BOTH: "both"}


@dataclass
class WorkerState:
    worker_id: str
    role: str
    address: str
    incarnation: str
    model_identity: str
    block_size: int
    max_model_len: int
    load: wpb.WorkerLoad
    last_seen: float
    channel: grpc.aio.Channel
    decode: worker_pb2_grpc.DecodeWorkerStub | None = None
    prefill: worker_pb2_grpc.PrefillWorkerStub | None = None
    # Router-side accounting since the last heartbeat.
    pending_prompt_tokens: int = 0
    pending_blocks: int = 0
    inflight: int = 0
    suspect_until: float = 0.0
    block_hashes: set[int] = field(default_factory=set)

    @property
    def draining(self) -> bool:
        return self.load.draining

    def usable(self, now: float) -> bool:
        return not self.load.draining and now >= self.suspect_until

    @property
    def free_blocks_estimate(self) -> int:
        return self.load.free_blocks - self.pending_blocks

    @property
    def queued_tokens_estimate(self) -> int:
        return self.load.queued_prompt_tokens + self.pending_prompt_tokens


class WorkerRegistry:
    def __init__(self, *, heartbeat_interval_s: float = 1.0, missed_beats: int = 3,
                 suspect_s: float = 2.0, model_identity: str | None = None):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.timeout_s = heartbeat_interval_s * missed_beats
        self.suspect_s = suspect_s
        self.model_identity = model_identity
        self.workers: dict[str, WorkerState] = {}
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    # -- heartbeats ----------------------------------------------------------------------------
    def heartbeat(self, req: wpb.HeartbeatRequest) -> wpb.HeartbeatResponse:
        info, now = req.worker, time.monotonic()
        if not info.worker_id or not info.address or info.role not in ROLE_NAMES:
            raise ValueError("heartbeat needs worker_id, address and a role")
        if self.model_identity and info.model_identity != self.model_identity:
            raise ValueError(f"worker {info.worker_id} serves model {info.model_identity}, this "
                             f"router serves {self.model_identity}")
        w = self.workers.get(info.worker_id)
        if w is not None and (w.incarnation != info.incarnation or w.address != info.address):
            logger.info("worker %s restarted (incarnation %s -> %s)", info.worker_id,
                        w.incarnation, info.incarnation)
            self._remove(info.worker_id)
            w = None
        want_full = False
        if w is None:
            w = self._add(info, req.load, now)
            want_full = not req.full_block_set
        else:
            w.load = req.load
            w.last_seen = now
            w.pending_prompt_tokens = 0
            w.pending_blocks = 0
        if req.full_block_set:
            w.block_hashes = set(req.added_block_hashes)
        else:
            w.block_hashes.difference_update(req.removed_block_hashes)
            w.block_hashes.update(req.added_block_hashes)
        return wpb.HeartbeatResponse(interval_s=self.heartbeat_interval_s,
                                     want_full_block_set=want_full)

    def _add(self, info: wpb.WorkerInfo, load: wpb.WorkerLoad, now: float) -> WorkerState:
        ch = insecure_channel(info.address)
        role = ROLE_NAMES[info.role]
        w = WorkerState(
            worker_id=info.worker_id, role=role, address=info.address,
            incarnation=info.incarnation, model_identity=info.model_identity,
            block_size=info.block_size, max_model_len=info.max_model_len, load=load,
            last_seen=now, channel=ch,
            decode=worker_pb2_grpc.DecodeWorkerStub(ch) if role in ("decode", "both") else None,
            prefill=worker_pb2_grpc.PrefillWorkerStub(ch) if role == "prefill" else None,
        )
        self.workers[info.worker_id] = w
        logger.info("worker %s (%s) joined at %s", w.worker_id, role, w.address)
        self._changed.set()
        return w

    def _remove(self, worker_id: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            asyncio.get_running_loop().create_task(w.channel.close())
            self._changed.set()

    # -- queries -------------------------------------------------------------------------------
    def alive(self, role: str) -> list[WorkerState]:
        now = time.monotonic()
        return [w for w in self.workers.values() if w.role == role and w.usable(now)]

    def status(self) -> list[wpb.WorkerStatus]:
        now = time.monotonic()
        role = {v: k for k, v in ROLE_NAMES.items()}
        return [wpb.WorkerStatus(
            info=wpb.WorkerInfo(worker_id=w.worker_id, role=role[w.role], address=w.address,
                                incarnation=w.incarnation, model_identity=w.model_identity,
                                block_size=w.block_size, max_model_len=w.max_model_len),
            load=w.load, last_seen_ms_ago=(now - w.last_seen) * 1000.0)
            for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]

    def mark_suspect(self, worker_id: str, why: str) -> None:
        """Keep a worker that just failed a call out of routing for a moment."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.suspect_until = time.monotonic() + self.suspect_s
            logger.warning("worker %s suspect for %.1fs: %s", worker_id, self.suspect_s, why)

    async def wait_for(self, role: str, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.alive(role)) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.1))
        return True

    # -- expiry --------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._reap())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for w in list(self.workers.values()):
            await w.channel.close()
        self.workers.clear()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s / 2)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if now - w.last_seen > self.timeout_s:
                    logger.warning("worker %s missed heartbeats for %.1fs: removed", w.worker_id,
                                   now - w.last_seen)
                    self._remove(w.worker_id)
