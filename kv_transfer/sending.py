"""The sending side of ``NixlConnector`` (prefill engine): a request's prompt KV streamed to its
``KVDestination`` while it is computed, then one notification.

``start_step`` plans the blocks each scheduled request touches (``send_plan``), ``save_layer(L)``
hands layer L's writes to the I/O thread (``transfer_thread``) while layer L+1 computes,
``end_step`` posts any layer the model did not report (every layer, where the config's
``layerwise`` resolves to off: ``streams_layerwise``). A sliding-window layer is written only
the blocks its receiver will still read (``engine/kv_window.py``). Under the hybrid KV layout
(``engine/hybrid_kv.py``) both sides address a block as its page per layer group, and a write
is one group's slots of those pages (``kv_window.PageWrites``). ``finished`` (the engine is
done with the request: its blocks are still being read) sends what is left, and once every
write is done the notification goes out exactly once; then ``take`` names the request in
``sent``. Aborted or failed requests are never notified: ``failed`` names them, then ``sent``.

A ``PendingDestination`` is a prefill sent before its destination was reserved: it writes
nothing until ``destination_ready``; then blocks already computed go at once (mid-step: the
layers already saved; after it finished: all of them). ``abandon`` gives up one whose
destination will never be named. A fenced notification (its receiver gave the blocks up) is
never written under again. A sender that cannot prove it is still listed by a router fences
itself (``self_fence``): requests it knew before the lapse, and writes queued then, never go
out. Bookkeeping lives in ``tracker``; this class routes between it and
the I/O thread, under one lock (the engine thread vs the I/O thread).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvrelay.common.timeline import mark
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.kv_window import LayerWindows, PageWrites, block_needs
from kvrelay.engine.sequence import FinishReason
from kvrelay.kv_transfer.config import NixlConnectorConfig
from kvrelay.kv_transfer.cuda_sync import record_ready_event
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.messages import KVDestination, PendingDestination, destination_of
from kvrelay.kv_transfer.nixl_transport import NixlTransport
from kvrelay.kv_transfer.rank_agents import RankedTransport
from kvrelay.kv_transfer.self_fence import SelfFence
from kvrelay.kv_transfer.send_tracker import (
    MAX_FENCED,
    Awaiting,
    BoundedSet,
    NotifJob,
    PeerWrites,
    PlannedWrite,
    SendTracker,
)
from kvrelay.kv_transfer.transfer_thread import TransferThread, WriteJob

if TYPE_CHECKING:
    from kvrelay.engine.kv_cache import KVCacheSpec
    from kvrelay.engine.sequence import Sequence

logger = logging.getLogger(__name__)
_ABORTED = (FinishReason.ABORT, FinishReason.ERROR)
_LAPSED = ("this prefill worker could not prove its lease was still current (no router answered "
           "its heartbeats in time): it fenced itself")


def streams_layerwise(mode: str, device: torch.device, cores: int | None = None,
                      threads: int | None = None) -> bool:
    """Whether a step's KV goes layer by layer (``NixlConnectorConfig.layerwise``). "auto": on
    a GPU yes; on a CPU only when the process may run on more cores (``cores``, default its
    affinity) than its compute uses (``threads``, default torch's): the UCX copy runs in the
    I/O thread, so with no core of its own each per-layer post takes the compute's (measured
    on one core: a 32-token prefill's compute 1-2 ms longer, a 512-token hand-off ~2 ms)."""
    if mode != "auto":
        return mode == "on"
    if device.type == "cuda":
        return True
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
    return cores > (torch.get_num_threads() if threads is None else threads)


class SendEvents(NamedTuple):
    sent: list[str]  # notified (or given up): their blocks may be freed
    failed: list[tuple[str, str]]  # (request id, reason)
    abandoned: list[str]  # finished, but no destination was ever named: blocks go back


class Sending:
    """The prefill role's half of ``NixlConnector`` (which delegates to it); see above."""

    def __init__(self, config: NixlConnectorConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # guards the trackers (engine thread vs I/O thread)
        self._send = SendTracker()
        self._transport: NixlTransport | RankedTransport | None = None
        self._thread: TransferThread | None = None
        self._spec: KVCacheSpec | None = None
        self._cuda = False
        self._device: torch.device | None = None
        self._layerwise = True
        self._step: dict[tuple[str, str | None], PeerWrites] = {}
        self._saved: set[int] = set()
        self._unnamed: list[ScheduledSeq] = []  # in this step, destination not named yet
        self.wake: Callable[[], None] = _nothing  # the engine loop's, called by the I/O thread
        self._fenced = BoundedSet(MAX_FENCED)  # notifications whose receivers gave them up
        self._awaiting: dict[str, Awaiting] = {}  # finished, destination not named yet
        self._abandoned: list[str] = []  # awaiting ones given up: their blocks go back
        self.proof = SelfFence(config.self_fence_s)  # may we still write (``self_fence``)
        self._epoch_of: OrderedDict[str, int] = OrderedDict()  # request -> epoch it arrived in
        self._step_epoch: int | None = None  # the epoch this step's writes were planned in
        # Each layer's window: a windowed layer gets only the blocks its receiver still reads
        # (and under the hybrid KV layout, each layer group its own pages).
        self._windows: LayerWindows | PageWrites = LayerWindows(())

    def attach(self, transport: NixlTransport | RankedTransport, spec: KVCacheSpec,
               device: torch.device) -> None:
        """The registered KV cache's transport: nothing is planned or sent before."""
        self._transport = transport
        self._spec = spec
        self._windows = LayerWindows(spec.layer_windows) if spec.groups is None \
            else PageWrites(spec.groups)
        self._cuda = device.type == "cuda"
        self._device = device
        self._layerwise = streams_layerwise(self.config.layerwise, device)
        logger.debug("KV sent %s (layerwise=%s)", "layer by layer" if self._layerwise
                    else "whole, as each step's forward ends", self.config.layerwise)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()

    @property
    def transport(self) -> NixlTransport | RankedTransport:
        if self._transport is None:
            raise RuntimeError("register_kv_cache() first")
        return self._transport

    # -- the step ------------------------------------------------------------------------------
    def start_step(self, scheduled: Seq[ScheduledSeq]) -> None:
        self._step, self._saved, self._unnamed = {}, set(), []
        self._step_epoch = None
        if self._spec is None:
            return
        with self._lock:
            for seq, n in scheduled:
                params = seq.kv_transfer_params
                dest = destination_of(params)
                if dest is not None:
                    self._plan_into_step(seq, n, dest)
                elif isinstance(params, PendingDestination):
                    self._unnamed.append(ScheduledSeq(seq, n))  # it may be named mid-step

    def _plan_into_step(self, seq: Sequence, n: int, dest: KVDestination) -> PlannedWrite | None:
        """Plan this step's blocks of ``seq`` into the step's writes (under the lock)."""
        assert self._spec is not None
        if dest.notif in self._fenced:
            self._send.refuse(seq.request_id, dest, "its receiver gave the blocks up")
        epoch = self._current(seq.request_id)
        if epoch is None:
            self._send.refuse(seq.request_id, dest, _LAPSED)
        pw = self._send.plan(seq.request_id, dest, self.local_table(seq),
                             seq.num_computed_tokens, n,
                             seq.num_prompt_tokens, self._spec.block_size,
                             self.transport.peer_incarnation(dest.peer))
        if pw is None:
            return None
        self._step_epoch = epoch  # every request planned this step has the current one
        w = self._step.setdefault((dest.peer, pw.incarnation), PeerWrites())
        w.local += pw.local
        w.remote += pw.remote
        w.needs += self._needs(seq.num_prompt_tokens, pw)
        w.request_ids.append(seq.request_id)
        return pw

    def local_table(self, seq: Sequence) -> list:
        """What a plan pairs with the destination's: the sequence's blocks, or under the hybrid
        KV layout its page of each layer group per block (``seq.page_tables`` name a page
        wherever the handoff reads one: its windowed groups hold theirs from the window on)."""
        assert self._spec is not None
        if self._spec.groups is None:
            return list(seq.block_table)
        assert seq.page_tables is not None
        return list(zip(*seq.page_tables, strict=True))

    def _needs(self, num_prompt_tokens: int, pw: PlannedWrite) -> list[int]:
        """Each of ``pw``'s block pairs' smallest window that reads it (``engine/kv_window.py``)."""
        assert self._spec is not None
        return block_needs(pw.first, len(pw.local), num_prompt_tokens, self._spec.block_size)

    def _adopt_named(self) -> None:
        """Requests whose destination was named while this step computes join its writes: the
        layers already saved go at once, the later ones with everyone's."""
        named: list[tuple[str, KVDestination, PlannedWrite]] = []
        with self._lock:
            unnamed = []
            for s in self._unnamed:
                dest = destination_of(s.seq.kv_transfer_params)
                if dest is None:
                    unnamed.append(s)
                    continue
                pw = self._plan_into_step(s.seq, s.num_new_tokens, dest)
                if pw is not None:
                    named.append((s.seq.request_id, dest, pw,
                                  self._needs(s.seq.num_prompt_tokens, pw)))
            self._unnamed = unnamed
            jobs = []
            if self._saved:
                done = tuple(sorted(self._saved))
                for rid, dest, pw, needs in named:
                    for lw in self._windows.split(done, pw.local, pw.remote, needs):
                        jobs.append(WriteJob(dest.peer, lw.layers, lw.local, lw.remote, (rid,),
                                             pw.incarnation, None, self._step_epoch))
                        self._send.posted([rid])
        for job in jobs:
            self._io().submit(job._replace(ready=self._ready_event()))

    def wants_layer_hooks(self, scheduled: Seq[ScheduledSeq]) -> bool:
        """A step that sends KV streams it layer by layer from ``save_layer``; one that sends
        nothing (a decode worker's decodes) may run as a CUDA graph. Not layerwise: none."""
        if self._spec is None or not self._layerwise:
            return False
        for seq, _ in scheduled:
            params = seq.kv_transfer_params
            if destination_of(params) is not None or isinstance(params, PendingDestination):
                return True
        return False

    def save_layer(self, layer: int) -> None:
        if not self._layerwise:  # end_step posts every layer
            return
        if self._unnamed:
            self._adopt_named()
        if self._step and layer not in self._saved:
            self._saved.add(layer)
            self._submit((layer,))

    def end_step(self) -> None:
        if self._unnamed:
            self._adopt_named()
        if self._step:
            assert self._spec is not None
            rest = tuple(x for x in range(self._spec.model_layers) if x not in self._saved)
            if rest:  # the model did not report these layers: send them now
                self._submit(rest)
        self._step, self._saved, self._unnamed = {}, set(), []

    def _ready_event(self) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        assert self._device is not None
        # save_layer runs when kernels are queued, not done
        return record_ready_event(self._device)

    def _submit(self, layers: tuple[int, ...]) -> None:
        ready = self._ready_event()
        thread = self._io()
        for (peer, incarnation), w in self._step.items():
            for lw in self._windows.split(layers, w.local, w.remote, w.needs):
                job = WriteJob(peer, lw.layers, lw.local, lw.remote, tuple(w.request_ids),
                               incarnation, ready, self._step_epoch)
                with self._lock:
                    self._send.posted(job.request_ids)
                thread.submit(job)

    def _io(self) -> TransferThread:
        if self._thread is None:
            self._thread = TransferThread(self.transport, self._on_write_end, self._on_notif_end,
                                          max_wait_s=self.config.max_poll_interval_s,
                                          device=self._device,
                                          may_post=lambda job: self.proof.valid(job.epoch))
        return self._thread

    def _on_write_end(self, job: WriteJob, err: KVTransferError | None) -> list[NotifJob]:
        with self._lock:
            if err is None:
                jobs = self._send.write_done(job.request_ids)
            else:
                jobs = self._send.write_failed(job.request_ids, _reason(err))
        for nj in jobs:
            mark("kv_written", nj.request_id)
        if err is not None:
            self.wake()  # ``failed`` has news for the engine
        return jobs

    def _on_notif_end(self, job: NotifJob, err: KVTransferError | None) -> None:
        mark("kv_notified", job.request_id)
        with self._lock:
            self._send.notif_done(job.request_id, None if err is None else _reason(err))
        self.wake()  # ``sent`` (or ``failed``) names the request now

    # -- fencing -------------------------------------------------------------------------------
    def fence(self, notif: bytes) -> None:
        """The receiver gave up this transfer: nothing is written under ``notif`` from now on
        (a request carrying it writes nothing). Call on the engine thread."""
        with self._lock:
            self._fenced.add(notif)

    def admit(self, request_id: str) -> bool:
        """A request arrived that will write KV: False when this sender cannot prove it is
        listed now (or is settling after a lapse), and must refuse it."""
        epoch = self.proof.admit()
        if epoch is None:
            return False
        with self._lock:
            self._epoch_of[request_id] = epoch
            self._epoch_of.move_to_end(request_id)
            while len(self._epoch_of) > MAX_FENCED:
                self._epoch_of.popitem(last=False)
        return True

    def _current(self, request_id: str) -> int | None:
        """The request's epoch if it may still write (under the lock); None: fenced. A request
        that was never admitted (an engine driven directly) is admitted now."""
        if not self.proof.enabled:
            return 0
        epoch = self._epoch_of.get(request_id)
        if epoch is None:
            epoch = self.proof.admit()
            if epoch is None:
                return None
            self._epoch_of[request_id] = epoch
        return epoch if self.proof.valid(epoch) else None

    def is_fenced(self, notif: bytes) -> bool:
        with self._lock:
            return notif in self._fenced

    def still_sending(self, request_id: str) -> bool:
        """Whether a write or the final notification of the request may still go out."""
        with self._lock:
            return self._send.tracks(request_id)

    # -- the request's end ---------------------------------------------------------------------
    def finished(self, seq: Sequence, params: KVDestination | PendingDestination) -> bool:
        """The engine is done with a sending request. True: its blocks are still being read
        (``sent`` names it once they are free)."""
        mark("kv_finished", seq.request_id)
        rid = seq.request_id
        aborted = seq.finish_reason in _ABORTED
        dest = destination_of(params)
        if dest is None:
            assert isinstance(params, PendingDestination)
            if aborted and params.close():
                return False  # no destination ever: nothing was or will be written
            with self._lock:  # against ``destination_ready`` and ``abandon``
                if params.closed:  # given up (its caller went away) before it finished
                    return False
                if params.dest is None:
                    self._awaiting[rid] = Awaiting(params, self.local_table(seq),
                                                   seq.num_prompt_tokens)
                    return True
            dest = params.dest
        self._finish_send(rid, dest, self.local_table(seq), seq.num_prompt_tokens, aborted)
        return True

    def _finish_send(self, request_id: str, dest: KVDestination, block_table: list,
                     num_prompt_tokens: int, aborted: bool) -> None:
        """The engine is done with a sending request: blocks its destination was named too late
        for go now (all layers), then the notification once every write has ended."""
        assert self._spec is not None
        with self._lock:
            epoch = None if aborted else self._current(request_id)
            if not aborted and epoch is None:
                self._send.refuse(request_id, dest, _LAPSED)
            late = None if aborted else self._send.catch_up(
                request_id, dest, block_table, num_prompt_tokens, self._spec.block_size,
                self.transport.peer_incarnation(dest.peer))
            writes = [] if late is None else [
                WriteJob(dest.peer, lw.layers, lw.local, lw.remote, (request_id,),
                         late.incarnation, epoch=epoch)
                for lw in self._windows.split(range(self._spec.model_layers), late.local,
                                              late.remote, self._needs(num_prompt_tokens, late))]
            for _ in writes:
                self._send.posted([request_id])
            jobs = self._send.finish(request_id, dest, aborted=aborted)
        for write in writes:
            self._io().submit(write)
        for job in jobs:
            mark("kv_written", job.request_id)
            self._io().submit(job)
        if not jobs and not writes:  # done already (a write had failed): ``take_events``
            self.wake()

    def destination_ready(self, request_id: str) -> None:
        """The request's ``PendingDestination`` was just resolved (any thread): if it finished
        before, its KV goes now."""
        with self._lock:
            aw = self._awaiting.pop(request_id, None)
        if aw is not None and aw.params.dest is not None:
            self._finish_send(request_id, aw.params.dest, aw.block_table, aw.num_prompt_tokens,
                              aborted=False)

    def abandon(self, request_id: str) -> bool:
        """Its destination will never be named (the router gave up): a request that finished
        waiting for one gives its blocks back. False: it was not waiting."""
        with self._lock:
            aw = self._awaiting.pop(request_id, None)
            if aw is None or not aw.params.close():  # (close: also for one still computing)
                if aw is not None:  # resolved meanwhile: it sends after all
                    self._awaiting[request_id] = aw
                return False
            self._abandoned.append(request_id)
        self.wake()
        return True

    def take(self) -> SendEvents:
        """What happened since the last call (``NixlConnector.take_events``)."""
        with self._lock:
            send = self._send.take()
            abandoned, self._abandoned = self._abandoned, []
        return SendEvents(send.sent, send.failed, abandoned)

    def has_pending(self) -> bool:
        with self._lock:
            return self._send.has_pending()


def _nothing() -> None:
    return None


def _reason(err: KVTransferError) -> str:
    return f"{err} (retriable)" if err.retriable else str(err)
