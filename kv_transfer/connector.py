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
  layers already saved; after it finished: all of them). The sending side's state (the step's
  writes, fenced notifications, requests awaiting a destination) is ``sending.Sending``.
- ``KVExpectation`` (decode engine): ``request_waiting_for_kv`` opens an expectation;
  ``take_events`` polls NIXL notifications and reports the request in ``received``. The
  receiving side's state (expectations bound to their sender, blocks held for a sender that
  may still write) is ``receiving.Receiving``.

It is also the worker's one KV API (the decode and prefill services call it directly):
``peer_info_bytes()`` (our endpoint, for the gRPC channel), ``add_peer``/``has_peer``/
``evict_peer`` (before the first request to a decode worker, and again when its incarnation
changed), and the lease-keyed calls: ``expectation`` and ``destination`` build a request's
``kv_transfer_params``, ``fence``/``is_fenced`` stop a sender writing into a lease its receiver
gave up, ``bind_sender``/``settle`` move or end a receiver's hold. Bookkeeping lives in
``send_tracker``/``recv_tracker``; this module owns the transport and routes the engine's calls
to the side they concern.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from kvrelay.common.timeline import mark
from kvrelay.engine.kv_connector import KVConnector, RankKV, ScheduledSeq, TransferEvents
from kvrelay.engine.kv_window import LayerWindows
from kvrelay.engine.tensor_parallel import preload_in_ranks
from kvrelay.kv_transfer.config import NixlConnectorConfig
from kvrelay.kv_transfer.cuda_sync import bind_thread_to
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import KVLayout, device_kind_of
from kvrelay.kv_transfer.messages import (
    KVDestination,
    KVExpectation,
    PeerInfo,
    PendingDestination,
)
from kvrelay.kv_transfer.nixl_transport import UCX_PRELOAD_MODULE, NixlTransport
from kvrelay.kv_transfer.notice import lease_key
from kvrelay.kv_transfer.rank_agents import RankedTransport
from kvrelay.kv_transfer.receiver_progress import ReceiverProgress
from kvrelay.kv_transfer.receiving import OnHold, Receiving
from kvrelay.kv_transfer.sending import Sending

if TYPE_CHECKING:
    from kvrelay.engine.kv_cache import KVCacheSpec
    from kvrelay.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class NixlConnector(KVConnector):
    def __init__(self, config: NixlConnectorConfig) -> None:
        self.config = config
        # Under TP every rank makes an agent: their fork server loads UCX once for them.
        preload_in_ranks(UCX_PRELOAD_MODULE)
        self._tx = Sending(config)
        self._rx = Receiving(config.sender_gone_grace_s, config.quarantine_backstop_s)
        self._transport: NixlTransport | RankedTransport | None = None
        self._device: torch.device | None = None
        self._recv_progress: ReceiverProgress | None = None
        self._lend_progress: ReceiverProgress | None = None
        self._loans = 0  # exports open: a peer may be reading our blocks (``lending``)
        self._loans_lock = threading.Lock()
        self._spec: KVCacheSpec | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def register_kv_cache(self, kv: torch.Tensor, spec: KVCacheSpec,
                          ranks: RankKV | None = None) -> None:
        if self._transport is not None:
            raise RuntimeError("register_kv_cache may be called once")
        if kv.is_cuda:
            from kvrelay.engine.cuda.memory import refuse_expandable_segments

            refuse_expandable_segments(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        tp: dict[str, Any] = {}
        if ranks is not None:
            tp = {"head_ranges": ranks.head_ranges, "model_kv_heads": ranks.model_kv_heads}
        layout = KVLayout.from_spec(spec, self.config.model_id, device_kind_of(kv.device), **tp)
        local = NixlTransport(self.config.agent_name, kv, layout,
                              write_timeout_s=self.config.write_timeout_s,
                              rank_kvs=() if ranks is None else ranks.others,
                              slots=(ranks.slots or None) if ranks is not None else None)
        if ranks is not None and ranks.services is not None:
            try:  # tensor parallelism: every rank's agent writes its own KV (rank_agents.py)
                self._transport = RankedTransport(local, ranks.services)
            except BaseException:
                local.close()
                raise
        else:
            self._transport = local
        self._tx.attach(self._transport, spec, kv.device)
        self._spec = spec
        self._device = kv.device
        if kv.is_cuda:  # GPU steps are long; the CPU path keeps progressing from the engine
            device = kv.device
            self._recv_progress = ReceiverProgress(
                self._transport.progress, self._rx.expecting, self.config.max_poll_interval_s,
                on_start=lambda: bind_thread_to(device))

        transport = self._transport
        self._lend_progress = ReceiverProgress(
            transport.progress, lambda: self._loans > 0, self.config.max_poll_interval_s,
            on_start=lambda: bind_thread_to(kv.device), name="kv-lend-progress")

    def close(self) -> None:
        if self._recv_progress is not None:
            self._recv_progress.close()
        if self._lend_progress is not None:
            self._lend_progress.close()
        self._tx.close()
        if self._transport is not None:
            self._transport.close()

    @property
    def transport(self) -> NixlTransport | RankedTransport:
        if self._transport is None:
            raise RuntimeError("register_kv_cache() first")
        return self._transport

    # -- control plane -------------------------------------------------------------------------
    def peer_info(self) -> PeerInfo:
        """Our endpoint, to publish on the control channel (``PeerInfo.to_bytes()``)."""
        return self.transport.peer_info()

    @property
    def agent_name(self) -> str:
        return self.config.agent_name

    @property
    def incarnation(self) -> str:
        return self.peer_info().incarnation

    def peer_info_bytes(self) -> bytes:
        """Our endpoint as published on the control channel (GetTransferInfo)."""
        return self.peer_info().to_bytes()

    def add_peer(self, info: PeerInfo | bytes) -> bool:
        """Connect to a decode worker (no-op if this incarnation is known); ``info`` as it
        came over the control channel, or parsed. Raises ``IncompatibleKVLayout`` with the
        flag to change when its KV layout differs."""
        bind_thread_to(self._device)  # UCX's CUDA transports need this thread's context first
        if isinstance(info, bytes):
            info = PeerInfo.from_bytes(info)
        return self.transport.add_peer(info)

    def has_peer(self, agent_name: str, incarnation: str) -> bool:
        """Whether ``agent_name`` is connected as that incarnation (else add it again)."""
        return self.peer_incarnation(agent_name) == incarnation

    def peer_incarnation(self, name: str) -> str | None:
        """The incarnation we hold for ``name`` (None: unknown): compare with the one the peer
        advertises to decide whether to fetch and add its ``PeerInfo`` again."""
        return self.transport.peer_incarnation(name)

    def evict_peer(self, name: str) -> bool:
        return self.transport.evict_peer(name)

    # -- prefix pull: reading a peer's blocks, lending ours ------------------------------------
    def read_blocks(self, peer: str, remote_block_ids: Seq[int], local_block_ids: Seq[int], *,
                    timeout_s: float, incarnation: str | None = None,
                    remote_pages: Seq[int] = (), local_pages: Seq[int] = ()) -> int:
        """Read every layer's K and V of ``peer``'s blocks into ours (a prefix pulled instead
        of recomputed) and wait for it, at most ``timeout_s``; returns the bytes read. Under
        the hybrid KV layout the blocks' pages per layer group are read instead (each side's
        ``share_pages``, block after block): each group's pages that we hold (``read_parts``).
        Blocks: call it from a thread of its own, never the engine's or an event loop. Raises
        ``KVTransferError`` (the read released: the caller drops what it read)."""
        bind_thread_to(self._device)
        tr = self.transport
        parts = self.read_parts(len(local_block_ids), remote_pages, local_pages) \
            if local_pages else [(None, remote_block_ids, local_block_ids)]
        handles, err = [], None
        try:
            for slots, remote, local in parts:
                handles.append(tr.read(peer, remote, local, incarnation=incarnation,
                                       timeout_s=timeout_s, layers=slots))
        except KVTransferError as e:
            err = e
        for handle in handles:  # every posted read ends before our blocks may be dropped
            try:
                tr.wait(handle, timeout=timeout_s)
            except KVTransferError as e:
                err = err or e
        if err is not None:
            raise err
        return sum(h.nbytes for h in handles)

    def read_parts(self, num_blocks: int, remote_pages: Seq[int], local_pages: Seq[int]
                   ) -> list[tuple[tuple[int, ...], list[int], list[int]]]:
        """The hybrid layout's reads of ``num_blocks`` blocks: per layer group, (its slots, the
        peer's pages, ours) of the blocks where we hold a page of the group. Raises
        ``KVTransferError`` where the peer holds none there (it cannot serve that prefix)."""
        assert self._spec is not None and self._spec.groups is not None
        groups = self._spec.groups
        n = groups.num_groups
        if len(remote_pages) != n * num_blocks or len(local_pages) != n * num_blocks:
            raise KVTransferError(f"a pull of {num_blocks} blocks of {n} layer groups names "
                                  f"{len(remote_pages)} pages there and {len(local_pages)} here",
                                  retriable=False)
        parts = []
        for g, members in enumerate(groups.layers):
            keep = [i for i in range(num_blocks) if local_pages[i * n + g] >= 0]
            remote = [remote_pages[i * n + g] for i in keep]
            if min(remote, default=0) < 0:
                raise KVTransferError(f"the holder lacks layer group {g}'s page of a block we "
                                      "read: it cannot serve this prefix", retriable=False)
            if keep:
                parts.append((tuple(range(len(members))), remote,
                              [local_pages[i * n + g] for i in keep]))
        return parts

    def lend(self, delta: int) -> None:
        """An export opened (+1) or ended (-1): while any is open a peer may read our blocks,
        so UCX is progressed meanwhile (its first read on a fresh connection waits for our
        handshake answer). Pair each +1 with one -1."""
        with self._loans_lock:
            self._loans = max(0, self._loans + delta)
        if delta > 0 and self._lend_progress is not None:
            self._lend_progress.kick()

    # -- worker side (the sending side's step: ``sending``) ----------------------------------------
    def start_step(self, scheduled: Seq[ScheduledSeq]) -> None:
        self._tx.start_step(scheduled)

    def wants_layer_hooks(self, scheduled: Seq[ScheduledSeq]) -> bool:
        """A step that sends KV streams it layer by layer from ``save_layer``; one that sends
        nothing (a decode worker's decodes) may run as a CUDA graph."""
        return self._tx.wants_layer_hooks(scheduled)

    def save_layer(self, layer: int) -> None:
        self._tx.save_layer(layer)

    def end_step(self) -> None:
        self._tx.end_step()

    # -- scheduler side ------------------------------------------------------------------------
    def request_waiting_for_kv(self, seq: Sequence) -> None:
        self._rx.expect(seq)
        if self._recv_progress is not None:
            self._recv_progress.kick()

    def bind_sender(self, request_id: str, sender: str, sender_address: str = "") -> bool:
        """Promise a waiting request's KV to another sender (a prefill retried elsewhere,
        before anything was written). False: the request waits for nothing here."""
        return self._rx.bind_sender(request_id, sender, sender_address or None)

    def settle(self, request_id: str) -> bool:
        """The control plane knows no write for this aborted receiver can still land: reuse its
        blocks now. False: nothing was held (no effect)."""
        return self._rx.settle(request_id)

    def observe_alive(self, senders: set[str], continuous: bool = True) -> None:
        """The agents some router lists as alive now (heartbeat answers). ``continuous`` False:
        some router went unheard long enough to have listed a sender unseen; absence restarts."""
        self._rx.observe_alive(senders, continuous)

    @property
    def on_hold(self) -> OnHold | None:
        """Called (engine thread) with each new hold: (request id, notification, sender, its
        control address); the worker asks the sender to fence it."""
        return self._rx.on_hold

    @on_hold.setter
    def on_hold(self, fn: OnHold | None) -> None:
        self._rx.on_hold = fn

    # -- leases: a transfer is named by its request and the decode worker's lease -------------
    # The notice names both, so a late notice from an earlier lease of the same request id is
    # never taken for this one (``notice.lease_key``).
    def expectation(self, request_id: str, lease_id: str, sender: str = "",
                    sender_address: str = "") -> KVExpectation:
        """A receiving request's ``kv_transfer_params``: wait for this lease's KV from
        ``sender`` (empty: not bound yet)."""
        return KVExpectation(lease_key(request_id, lease_id), self.config.kv_timeout_s,
                             sender or None, sender_address or None)

    def destination(self, request_id: str, agent_name: str, block_ids: list[int],
                    skip_blocks: int, lease_id: str, incarnation: str,
                    pages: Seq[Seq[int]] = ()) -> KVDestination:
        """A sending request's ``kv_transfer_params``: write into the lease's blocks (under the
        hybrid KV layout, their ``pages``: ``destination_pages``). The incarnation binds the
        writes to the process that granted the lease: if the decode worker restarted under
        the same name since, the transfer fails instead of writing into a stranger's blocks."""
        return KVDestination(agent_name, block_ids, skip_blocks,
                             lease_key(request_id, lease_id), incarnation=incarnation or None,
                             remote_pages=pages)

    def destination_pages(self, page_ids: Seq[int], num_blocks: int, skip_blocks: int,
                          num_prompt_tokens: int) -> tuple[tuple[int, ...], ...]:
        """A destination's pages per layer group of each of its ``num_blocks`` blocks, from the
        flat list a lease carries (a block's groups in order, -1: none), checked to hold every
        page the handoff writes; ``()`` under the one-table layout. Raises ValueError."""
        if self._spec is None:
            raise RuntimeError("register_kv_cache() first")
        spec = self._spec
        if spec.groups is None:
            if page_ids:
                raise ValueError("the destination names pages per layer group, but this worker "
                                 "keeps one block table for every layer (--hybrid-kv off)")
            return ()
        n = spec.groups.num_groups
        if len(page_ids) != n * num_blocks:
            raise ValueError(f"the destination names {len(page_ids)} pages for {num_blocks} "
                             f"blocks of {n} layer groups (--hybrid-kv auto): want "
                             f"{n * num_blocks}")
        pages = tuple(tuple(int(p) for p in page_ids[i * n:(i + 1) * n])
                      for i in range(num_blocks))
        missing = LayerWindows(spec.layer_windows).missing_pages(
            spec.groups, pages, skip_blocks, num_prompt_tokens, spec.block_size)
        if missing:
            block, group = missing[0]
            raise ValueError(f"the destination holds no page of layer group {group} for block "
                             f"{block} ({len(missing)} such), which the handoff writes")
        return pages

    def block_bytes(self) -> int:
        """Bytes one block costs across all layers, K and V."""
        if self._spec is None:
            raise RuntimeError("register_kv_cache() first")
        return self._spec.bytes_per_block_all_layers

    def handoff_bytes(self, dest: KVDestination, num_prompt_tokens: int) -> int:
        """Bytes a prompt's handoff to ``dest`` writes: its blocks past the peer's cached prefix,
        every plane (K and V, or a latent) of every layer that still reads them (a sliding-window
        layer: those in its window, ``engine/kv_window.py``)."""
        if self._spec is None:
            raise RuntimeError("register_kv_cache() first")
        spec = self._spec
        first = dest.skip_blocks
        count = min(len(dest.remote_block_ids), -(-num_prompt_tokens // spec.block_size)) - first
        if count <= 0:
            return 0
        windows = LayerWindows(spec.layer_windows or (None,) * spec.num_layers)
        pairs = windows.pairs_written(first, count, num_prompt_tokens, spec.block_size)
        return getattr(spec, "planes", 2) * pairs * spec.block_bytes  # K and V, or a latent

    # -- fencing (sending side) ----------------------------------------------------------------
    def fence(self, request_id: str, lease_id: str) -> bytes:
        """The receiver gave up this lease's transfer: nothing is written under it from now on
        (a request carrying it writes nothing); returns its notice key. Engine thread."""
        notif = lease_key(request_id, lease_id)
        self._tx.fence(notif)
        return notif

    # -- self-fencing (sending side): ``self_fence`` ---------------------------------------------
    def router_answered(self, sent_at: float) -> None:
        """A router answered the heartbeat sent at ``sent_at`` (monotonic): it listed us."""
        self._tx.proof.proved(sent_at)

    def admit_send(self, request_id: str) -> bool:
        """A prefill arrived: False when this worker cannot prove a router lists it now (or it
        is settling after such a lapse); the call must be refused before anything is written."""
        return self._tx.admit(request_id)

    def self_fence_lapses(self) -> int:
        """How many times this sender fenced itself (its proof ran out)."""
        return self._tx.proof.num_lapses

    def is_fenced(self, request_id: str, lease_id: str) -> bool:
        return self._tx.is_fenced(lease_key(request_id, lease_id))

    def is_fenced_notice(self, notif: bytes) -> bool:
        """``is_fenced`` by the notice key a destination carries."""
        return self._tx.is_fenced(notif)

    def still_sending(self, request_id: str) -> bool:
        """Whether a write or the final notification of the request may still go out."""
        return self._tx.still_sending(request_id)

    def counters(self) -> dict[str, int]:
        return self._rx.counters()

    def request_finished(self, seq: Sequence) -> bool:
        params = seq.kv_transfer_params
        if isinstance(params, (KVDestination, PendingDestination)):
            return self._tx.finished(seq, params)
        if isinstance(params, KVExpectation):
            return self._rx.finished(seq, params)
        return False

    def destination_ready(self, request_id: str) -> None:
        """The request's ``PendingDestination`` was just resolved (any thread): if it finished
        before, its KV goes now."""
        self._tx.destination_ready(request_id)

    def abandon(self, request_id: str) -> bool:
        """Its destination will never be named (the router gave up): a request that finished
        waiting for one gives its blocks back. False: it was not waiting."""
        return self._tx.abandon(request_id)

    def take_events(self) -> TransferEvents:
        # Only a receiver polls: on a sender the I/O thread may hold the transport for a copy.
        notifs = self.transport.get_notifs() if self._rx.expecting() else []
        recv, released = self._rx.take(notifs)
        send = self._tx.take()
        abandoned = send.abandoned
        for rid in recv.received:
            mark("kv_received", rid)
        for rid in send.sent:
            mark("kv_sent_seen", rid)
        # ``sent`` tells the engine it may free the blocks it held for these requests.
        return TransferEvents(send.sent + released + abandoned, recv.received,
                              send.failed + recv.failed
                              + [(r, "no destination was named for its KV") for r in abandoned])

    def has_pending(self) -> bool:
        return self._tx.has_pending() or self._rx.expecting()

    def set_waker(self, wake: Callable[[], None]) -> None:
        """The sending side's events come from the I/O thread, which calls ``wake`` after each
        notification (and failed write): an engine waiting only on sends can sleep."""
        self._tx.wake = wake

    def needs_polling(self) -> bool:
        """Receiving needs polls: NIXL notifications arrive only when we progress UCX, and
        expectation deadlines and quarantine ends are times, not events."""
        return self._rx.expecting()

