"""``NixlConnector``: the engine's KV connector for disaggregated prefill/decode over NIXL.

One class serves both roles; a request's ``kv_transfer_params`` says which side it is on:

- ``KVDestination`` (prefill engine): the request's prompt KV is streamed to the peer while it is
  computed. ``start_step`` plans the blocks each scheduled request touches (``send_plan``),
  ``save_layer(L)`` hands layer L's writes to the I/O thread (``transfer_thread``) while layer L+1
  computes, ``end_step`` posts any layer the model did not report. After ``request_finished``
  (which returns True: the blocks are still being read) and once every write is done, the
  notification goes out exactly once; then ``take_events().sent`` names the request.
  Aborted or failed requests are never notified: ``failed`` names them, then ``sent``.
  A ``PendingDestination`` is a prefill sent before its destination was reserved: it writes
  nothing until ``destination_ready``; then blocks already computed go at once (mid-step: the
  layers already saved; after it finished: all of them).
- ``KVExpectation`` (decode engine): ``request_waiting_for_kv`` opens an expectation;
  ``take_events`` polls NIXL notifications and reports the request in ``received``. The
  receiving side's state (expectations bound to their sender, blocks held for a sender that
  may still write) is ``receiving.Receiving``.

The control plane also uses ``peer_info()`` (our endpoint, for the gRPC channel) and
``add_peer(info)`` (before the first request to a decode worker, and again when the peer's
incarnation changed). Bookkeeping lives in ``tracker``; this module only routes between the
engine, the tracker and the I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from kvrelay.common.timeline import mark
from kvrelay.engine.kv_connector import KVConnector, RankKV, ScheduledSeq, TransferEvents
from kvrelay.engine.sequence import FinishReason
from kvrelay.kv_transfer.config import NixlConnectorConfig
from kvrelay.kv_transfer.cuda_sync import bind_thread_to, record_ready_event
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import KVLayout, device_kind_of
from kvrelay.kv_transfer.messages import (
    KVDestination,
    KVExpectation,
    PeerInfo,
    PendingDestination,
    destination_of,
)
from kvrelay.kv_transfer.nixl_transport import NixlTransport
from kvrelay.kv_transfer.receiver_progress import ReceiverProgress
from kvrelay.kv_transfer.receiving import OnHold, Receiving
from kvrelay.kv_transfer.tracker import (
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


class NixlConnector(KVConnector):
    def __init__(self, config: NixlConnectorConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # guards the trackers (engine thread vs I/O thread)
        self._send = SendTracker()
        self._rx = Receiving(config.sender_gone_grace_s, config.quarantine_backstop_s)
        self._transport: NixlTransport | None = None
        self._thread: TransferThread | None = None
        self._spec: KVCacheSpec | None = None
        self._cuda = False
        self._device: torch.device | None = None
        self._recv_progress: ReceiverProgress | None = None
        self._step: dict[tuple[str, str | None], PeerWrites] = {}
        self._saved: set[int] = set()
        self._unnamed: list[ScheduledSeq] = []  # in this step, destination not named yet
        self._wake: Callable[[], None] = _nothing  # the engine loop's, called by the I/O thread
        self._fenced = BoundedSet(MAX_FENCED)  # notifications whose receivers gave them up
        self._awaiting: dict[str, Awaiting] = {}  # finished, destination not named yet
        self._abandoned: list[str] = []  # awaiting ones given up: their blocks go back

    # -- lifecycle -----------------------------------------------------------------------------
    def register_kv_cache(self, kv: torch.Tensor, spec: KVCacheSpec,
                          ranks: RankKV | None = None) -> None:
        if self._transport is not None:
            raise RuntimeError("register_kv_cache may be called once")
        tp: dict[str, Any] = {}
        if ranks is not None:
            tp = {"head_ranges": ranks.head_ranges, "model_kv_heads": ranks.model_kv_heads}
        layout = KVLayout.from_spec(spec, self.config.model_id, device_kind_of(kv.device), **tp)
        self._transport = NixlTransport(self.config.agent_name, kv, layout,
                                        write_timeout_s=self.config.write_timeout_s,
                                        rank_kvs=() if ranks is None else ranks.others)
        self._spec = spec
        self._cuda = kv.is_cuda
        self._device = kv.device
        if self._cuda:  # GPU steps are long; the CPU path keeps progressing from the engine
            device = kv.device
            self._recv_progress = ReceiverProgress(
                self._transport.progress, self._rx.expecting, self.config.max_poll_interval_s,
                on_start=lambda: bind_thread_to(device))

    def close(self) -> None:
        if self._recv_progress is not None:
            self._recv_progress.close()
        if self._thread is not None:
            self._thread.close()
        if self._transport is not None:
            self._transport.close()

    @property
    def transport(self) -> NixlTransport:
        if self._transport is None:
            raise RuntimeError("register_kv_cache() first")
        return self._transport

    # -- control plane -------------------------------------------------------------------------
    def peer_info(self) -> PeerInfo:
        """Our endpoint, to publish on the control channel (``PeerInfo.to_bytes()``)."""
        return self.transport.peer_info()

    def add_peer(self, info: PeerInfo) -> bool:
        bind_thread_to(self._device)  # UCX's CUDA transports need this thread's context first
        """Connect to a decode worker (no-op if this incarnation is known). Raises
        ``IncompatibleKVLayout`` with the flag to change when its KV layout differs."""
        return self.transport.add_peer(info)

    def peer_incarnation(self, name: str) -> str | None:
        """The incarnation we hold for ``name`` (None: unknown): compare with the one the peer
        advertises to decide whether to fetch and add its ``PeerInfo`` again."""
        return self.transport.peer_incarnation(name)

    def evict_peer(self, name: str) -> bool:
        return self.transport.evict_peer(name)

    # -- worker side ---------------------------------------------------------------------------
    def start_step(self, scheduled: Seq[ScheduledSeq]) -> None:
        self._step, self._saved, self._unnamed = {}, set(), []
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
        pw = self._send.plan(seq.request_id, dest, seq.block_table, seq.num_computed_tokens, n,
                             seq.num_prompt_tokens, self._spec.block_size,
                             self.transport.peer_incarnation(dest.peer))
        if pw is None:
            return None
        w = self._step.setdefault((dest.peer, pw.incarnation), PeerWrites())
        w.local += pw.local
        w.remote += pw.remote
        w.request_ids.append(seq.request_id)
        return pw

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
                    named.append((s.seq.request_id, dest, pw))
            self._unnamed = unnamed
            if self._saved:
                self._send.posted(rid for rid, _, _ in named)
        if self._saved:
            done = tuple(sorted(self._saved))
            for rid, dest, pw in named:
                self._io().submit(WriteJob(dest.peer, done, pw.local, pw.remote, (rid,),
                                           pw.incarnation, self._ready_event()))

    def wants_layer_hooks(self, scheduled: Seq[ScheduledSeq]) -> bool:
        """A step that sends KV streams it layer by layer from ``save_layer``; one that sends
        nothing (a decode worker's decodes) may run as a CUDA graph."""
        if self._spec is None:
            return False
        for seq, _ in scheduled:
            params = seq.kv_transfer_params
            if destination_of(params) is not None or isinstance(params, PendingDestination):
                return True
        return False

    def save_layer(self, layer: int) -> None:
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
            rest = tuple(x for x in range(self._spec.num_layers) if x not in self._saved)
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
            job = WriteJob(peer, layers, w.local, w.remote, tuple(w.request_ids), incarnation,
                           ready)
            with self._lock:
                self._send.posted(job.request_ids)
            thread.submit(job)

    def _io(self) -> TransferThread:
        if self._thread is None:
            self._thread = TransferThread(self.transport, self._on_write_end, self._on_notif_end,
                                          max_wait_s=self.config.max_poll_interval_s,
                                          device=self._device)
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
            self._wake()  # ``failed`` has news for the engine
        return jobs

    def _on_notif_end(self, job: NotifJob, err: KVTransferError | None) -> None:
        mark("kv_notified", job.request_id)
        with self._lock:
            self._send.notif_done(job.request_id, None if err is None else _reason(err))
        self._wake()  # ``sent`` (or ``failed``) names the request now

    # -- scheduler side ------------------------------------------------------------------------
    def request_waiting_for_kv(self, seq: Sequence) -> None:
        self._rx.expect(seq)
        if self._recv_progress is not None:
            self._recv_progress.kick()

    def bind_sender(self, request_id: str, sender: str, sender_address: str | None = None
                    ) -> bool:
        """Promise a waiting request's KV to another sender (a prefill retried elsewhere,
        before anything was written). False: the request waits for nothing here."""
        return self._rx.bind_sender(request_id, sender, sender_address)

    def settle(self, request_id: str) -> bool:
        """The control plane knows no write for this aborted receiver can still land: reuse its
        blocks now. False: nothing was held (no effect)."""
        return self._rx.settle(request_id)

    def observe_alive(self, senders: set[str]) -> None:
        """The agents some router lists as alive now (heartbeat answers)."""
        self._rx.observe_alive(senders)

    @property
    def on_hold(self) -> OnHold | None:
        """Called (engine thread) with each new hold: (request id, notification, sender, its
        control address); the worker asks the sender to fence it."""
        return self._rx.on_hold

    @on_hold.setter
    def on_hold(self, fn: OnHold | None) -> None:
        self._rx.on_hold = fn

    # -- fencing (sending side) ----------------------------------------------------------------
    def fence(self, notif: bytes) -> None:
        """The receiver gave up this transfer: nothing is written under ``notif`` from now on
        (a request carrying it writes nothing). Call on the engine thread."""
        with self._lock:
            self._fenced.add(notif)

    def is_fenced(self, notif: bytes) -> bool:
        with self._lock:
            return notif in self._fenced

    def still_sending(self, request_id: str) -> bool:
        """Whether a write or the final notification of the request may still go out."""
        with self._lock:
            return self._send.tracks(request_id)

    def counters(self) -> dict[str, int]:
        return self._rx.counters()

    def request_finished(self, seq: Sequence) -> bool:
        params = seq.kv_transfer_params
        if isinstance(params, (KVDestination, PendingDestination)):
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
                        self._awaiting[rid] = Awaiting(params, list(seq.block_table),
                                                        seq.num_prompt_tokens)
                        return True
                dest = params.dest
            self._finish_send(rid, dest, list(seq.block_table), seq.num_prompt_tokens, aborted)
            return True
        if isinstance(params, KVExpectation):
            return self._rx.finished(seq, params)
        return False

    def _finish_send(self, request_id: str, dest: KVDestination, block_table: list[int],
                     num_prompt_tokens: int, aborted: bool) -> None:
        """The engine is done with a sending request: blocks its destination was named too late
        for go now (all layers), then the notification once every write has ended."""
        assert self._spec is not None
        with self._lock:
            late = None if aborted else self._send.catch_up(
                request_id, dest, block_table, num_prompt_tokens, self._spec.block_size,
                self.transport.peer_incarnation(dest.peer))
            if late is not None:
                self._send.posted([request_id])
            jobs = self._send.finish(request_id, dest, aborted=aborted)
        if late is not None:
            self._io().submit(WriteJob(dest.peer, tuple(range(self._spec.num_layers)),
                                       late.local, late.remote, (request_id,), late.incarnation))
        for job in jobs:
            mark("kv_written", job.request_id)
            self._io().submit(job)
        if not jobs and late is None:  # done already (a write had failed): ``take_events``
            self._wake()

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
        self._wake()
        return True

    def take_events(self) -> TransferEvents:
        # Only a receiver polls: on a sender the I/O thread may hold the transport for a copy.
        notifs = self.transport.get_notifs() if self._rx.expecting() else []
        recv, released = self._rx.take(notifs)
        with self._lock:
            send = self._send.take()
            abandoned, self._abandoned = self._abandoned, []
        for rid in recv.received:
            mark("kv_received", rid)
        for rid in send.sent:
            mark("kv_sent_seen", rid)
        # ``sent`` tells the engine it may free the blocks it held for these requests.
        return TransferEvents(send.sent + released + abandoned, recv.received,
                              send.failed + recv.failed
                              + [(r, "no destination was named for its KV") for r in abandoned])

    def has_pending(self) -> bool:
        with self._lock:
            sending = self._send.has_pending()
        return sending or self._rx.expecting()

    def set_waker(self, wake: Callable[[], None]) -> None:
        """The sending side's events come from the I/O thread, which calls ``wake`` after each
        notification (and failed write): an engine waiting only on sends can sleep."""
        self._wake = wake

    def needs_polling(self) -> bool:
        """Receiving needs polls: NIXL notifications arrive only when we progress UCX, and
        expectation deadlines and quarantine ends are times, not events."""
        return self._rx.expecting()


def _nothing() -> None:
    return None


def _reason(err: KVTransferError) -> str:
    return f"{err} (retriable)" if err.retriable else str(err)
