"""The sender's I/O thread: posts writes and notifications, polls completions, never spins.

Why a thread: on CPU the UCX copy (``process_vm_writev``) runs inside the posting call, so posting
layer L from ``save_layer`` on the engine thread would stall layer L+1's compute for the whole
copy. Here ``save_layer`` only enqueues; this thread posts (NIXL releases the GIL), so the copy
of layer L overlaps the compute of layer L+1 on another core. On CUDA the job carries an event
recorded after the layer's kernels; the thread waits on it before posting.

Waiting: idle, the thread blocks on its condition without a timeout (≈ 0 CPU). While writes are
in flight it polls them with timed waits backing off from ``min_wait_s`` to ``max_wait_s``, and
new jobs wake it at once. After sending a notification it keeps ticking progress for
``linger_s``: a notification that UCX could not send inline (endpoint still being wired up)
leaves only when this side's worker is progressed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from kvrelay.kv_transfer.cuda_sync import bind_thread_to
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.nixl_transport import NixlTransport, WriteHandle
from kvrelay.kv_transfer.rank_agents import RankedTransport
from kvrelay.kv_transfer.send_tracker import NotifJob

logger = logging.getLogger(__name__)


class WriteJob(NamedTuple):
    """K and V of ``layers`` for blocks ``local[i] -> remote[i]`` at ``peer``, on behalf of
    ``request_ids``."""

    peer: str
    layers: tuple[int, ...]
    local: list[int]
    remote: list[int]
    request_ids: tuple[str, ...]
    incarnation: str | None = None  # refuse if the peer restarted since (None: no check)
    ready: Any | None = None  # torch.cuda.Event to wait for before posting (None on CPU)
    epoch: int | None = None  # the sender's proof epoch it was planned in (``self_fence``)


OnWriteEnd = Callable[[WriteJob, KVTransferError | None], list[NotifJob]]
OnNotifEnd = Callable[[NotifJob, KVTransferError | None], None]
MayPost = Callable[[WriteJob], bool]


class TransferThread:
    def __init__(self, transport: NixlTransport | RankedTransport, on_write_end: OnWriteEnd,
                 on_notif_end: OnNotifEnd, *, min_wait_s: float = 5e-5,
                 max_wait_s: float = 2e-3, linger_s: float = 0.5,
                 device: Any | None = None, may_post: MayPost | None = None) -> None:
        self._transport = transport
        # Asked right before each post: False (the sender fenced itself) fails the job unposted.
        self._may_post = may_post
        self._on_write_end = on_write_end
        self._on_notif_end = on_notif_end
        self._min_wait, self._max_wait, self._linger = min_wait_s, max_wait_s, linger_s
        self._cond = threading.Condition()
        self._queue: list[WriteJob | NotifJob] = []
        self._stopping = False
        self._device = device  # a torch.device: the KV's GPU, made current in the thread
        self._thread = threading.Thread(target=self._run, name="kv-send", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob | NotifJob) -> None:
        with self._cond:
            if self._stopping:
                raise KVTransferError("the KV sender is closed", retriable=False)
            self._queue.append(job)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop; queued and in-flight work fails with a retriable error."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV sender thread did not stop within %.1f s", timeout)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        bind_thread_to(self._device)
        inflight: list[tuple[WriteJob, WriteHandle]] = []
        wait = self._min_wait
        linger_until = 0.0
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    if inflight or time.monotonic() < linger_until:
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()  # idle: sleep until a job arrives
                jobs, self._queue = self._queue, []
                stopping = self._stopping
            if stopping:
                self._abandon(jobs, inflight)
                return
            progressed = bool(jobs)
            notifs: list[NotifJob] = []
            for job in jobs:
                if isinstance(job, NotifJob):
                    notifs.append(job)
                else:
                    h = self._post(job, notifs)
                    if h is not None:
                        inflight.append((job, h))
            still = []
            for job, h in inflight:
                try:
                    done = self._transport.poll(h)
                except KVTransferError as e:
                    notifs += self._ended(job, e)
                    progressed = True
                    continue
                if done:
                    notifs += self._ended(job, None)
                    progressed = True
                else:
                    still.append((job, h))
            inflight = still
            for nj in notifs:
                self._notify(nj)
            if notifs:
                linger_until = time.monotonic() + self._linger
            elif not inflight and time.monotonic() < linger_until:
                self._safe(self._transport.progress)
            wait = self._min_wait if progressed else min(wait * 2, self._max_wait)

    def _post(self, job: WriteJob, notifs: list[NotifJob]) -> WriteHandle | None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            if self._may_post is not None and not self._may_post(job):
                raise KVTransferError("this prefill worker cannot prove its lease is still current "
                                      "(no router answered its heartbeats in time): it fenced "
                                      "itself", retriable=True, peer=job.peer)
            h = self._transport.write(job.peer, job.layers, job.local, job.remote,
                                      incarnation=job.incarnation)
        except KVTransferError as e:
            notifs += self._ended(job, e)
            return None
        except Exception as e:  # a bug must not kill the thread and strand the requests
            logger.exception("posting a KV write to %s", job.peer)
            notifs += self._ended(job, KVTransferError(repr(e), retriable=False, peer=job.peer))
            return None
        if h.done:
            notifs += self._ended(job, None)
            return None
        return h

    def _ended(self, job: WriteJob, err: KVTransferError | None) -> list[NotifJob]:
        if err is not None:
            logger.warning("KV write to %s for %s failed: %s", job.peer, list(job.request_ids),
                           err)
        try:
            return self._on_write_end(job, err)
        except Exception:
            logger.exception("KV write completion callback failed")
            return []

    def _notify(self, nj: NotifJob) -> None:
        err: KVTransferError | None = None
        try:
            self._transport.send_notif(nj.peer, nj.notif, incarnation=nj.incarnation)
        except KVTransferError as e:
            logger.warning("KV notification to %s for %s failed: %s", nj.peer, nj.request_id, e)
            err = e
        try:
            self._on_notif_end(nj, err)
        except Exception:
            logger.exception("KV notification callback failed")

    def _abandon(self, jobs: list[WriteJob | NotifJob],
                 inflight: list[tuple[WriteJob, WriteHandle]]) -> None:
        closed = KVTransferError("KV sender closed before the transfer completed", retriable=True)
        for job, h in inflight:
            self._safe(self._transport.cancel, h)
            self._ended(job, closed)
        for job in jobs:
            if isinstance(job, NotifJob):
                self._safe(self._on_notif_end, job, closed)
            else:
                self._ended(job, closed)

    @staticmethod
    def _safe(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("KV sender: %s failed", getattr(fn, "__name__", fn))
