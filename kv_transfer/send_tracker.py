"""The sender's per-request bookkeeping of a KV handoff: pure Python, no I/O, not thread-safe
(the connector serialises calls with its lock).

``SendTracker``, per request: which blocks are already covered, how many writes are in flight,
whether the engine finished it, whether something failed. The notification is released (as a
``NotifJob`` for the I/O side to send) exactly once: when the request is finished, nothing is in
flight and nothing failed. A failed or aborted request is never notified as complete; it is
reported in ``failed`` and then in ``sent`` once no write reads its blocks anymore. An aborted one
whose peer is still reachable gets an *abort notice* instead (an ``ABORTED`` notice,
``notice.py``), sent after its last write ended, so the receiver may reuse the blocks at once
rather than after its grace period. The receiver's side is ``recv_tracker.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvrelay.kv_transfer.messages import KVDestination, PendingDestination, remote_table
from kvrelay.kv_transfer.notice import NoticeKind, encode
from kvrelay.kv_transfer.send_plan import PlanError, blocks_to_send, map_blocks

logger = logging.getLogger(__name__)


class NotifJob(NamedTuple):
    request_id: str
    peer: str
    notif: bytes
    incarnation: str | None  # of the peer the request's writes went to


class PlannedWrite(NamedTuple):
    """A request's blocks for this step, bound to one incarnation of its peer (under the hybrid
    KV layout each block is its pages per layer group: ``Sending.local_table``)."""

    local: list
    remote: list
    incarnation: str | None
    first: int = 0  # the sequence's index of the block ``local[0]``


class SendOutcome(NamedTuple):
    sent: list[str]
    failed: list[tuple[str, str]]


@dataclass
class _Send:
    dest: KVDestination
    covered: int
    incarnation: str | None
    inflight: int = 0
    finished: bool = False
    notifying: bool = False
    failure: str | None = None
    aborted: bool = False
    sent_tokens: int = 0  # prompt tokens [0, sent_tokens) are planned to go (or are cached there)


class SendTracker:
    def __init__(self) -> None:
        self._reqs: dict[str, _Send] = {}
        self._sent: list[str] = []
        self._failed: list[tuple[str, str]] = []

    def _state(self, request_id: str, dest: KVDestination, incarnation: str | None) -> _Send:
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _Send(dest, dest.skip_blocks,
                                                dest.incarnation or incarnation)
        return st

    def plan(self, request_id: str, dest: KVDestination, block_table: list,
             start_token: int, num_new_tokens: int, num_prompt_tokens: int, block_size: int,
             peer_incarnation: str | None = None) -> PlannedWrite | None:
        """The blocks this step must send for the request (None: nothing, or it failed).
        ``peer_incarnation`` (the one known now) binds a request whose destination names none."""
        st = self._state(request_id, dest, peer_incarnation)
        if st.failure is not None or st.finished:
            return None
        rng = blocks_to_send(start_token, num_new_tokens, num_prompt_tokens, block_size,
                             st.covered, dest.skip_blocks)
        try:
            bm = map_blocks(block_table, remote_table(dest), rng)
        except PlanError as e:
            st.failure = str(e)
            return None
        st.covered = rng.covered
        st.sent_tokens = max(st.sent_tokens, min(start_token + num_new_tokens, num_prompt_tokens))
        return PlannedWrite(bm.local, bm.remote, st.incarnation, rng.start) if bm.local else None

    def catch_up(self, request_id: str, dest: KVDestination, block_table: list,
                 num_prompt_tokens: int, block_size: int,
                 peer_incarnation: str | None = None) -> PlannedWrite | None:
        """The prompt blocks computed but not yet planned (their destination came late), all
        layers at once; None when every prompt token is covered already."""
        st = self._state(request_id, dest, peer_incarnation)
        done = max(st.sent_tokens, dest.skip_blocks * block_size)
        if st.failure is not None or st.finished or done >= num_prompt_tokens:
            return None
        start = done // block_size * block_size  # a partial last block goes again, whole
        return self.plan(request_id, dest, block_table, start, num_prompt_tokens - start,
                         num_prompt_tokens, block_size, peer_incarnation)

    def refuse(self, request_id: str, dest: KVDestination, reason: str) -> None:
        """Never write for this request (its receiver fenced the transfer)."""
        st = self._state(request_id, dest, None)
        if st.failure is None:
            st.failure = reason

    def tracks(self, request_id: str) -> bool:
        """Whether the request may still write or notify."""
        return request_id in self._reqs

    def posted(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._reqs[rid].inflight += 1

    def write_done(self, request_ids: Iterable[str]) -> list[NotifJob]:
        return self._write_ended(request_ids, None)

    def write_failed(self, request_ids: Iterable[str], reason: str) -> list[NotifJob]:
        return self._write_ended(request_ids, reason)

    def _write_ended(self, request_ids: Iterable[str], failure: str | None) -> list[NotifJob]:
        jobs: list[NotifJob] = []
        for rid in request_ids:
            st = self._reqs[rid]
            assert st.inflight > 0, f"write ended for {rid} with nothing in flight"
            st.inflight -= 1
            if failure is not None and st.failure is None:
                st.failure = failure
            jobs += self._maybe_complete(rid)
        return jobs

    def finish(self, request_id: str, dest: KVDestination, *, aborted: bool) -> list[NotifJob]:
        """The engine is done with the request; its blocks stay until ``sent`` names it."""
        st = self._state(request_id, dest, None)
        st.finished = True
        if aborted and st.failure is None:
            st.failure = "request aborted before its KV was delivered"
            st.aborted = True
        return self._maybe_complete(request_id)

    def notif_done(self, request_id: str, error: str | None) -> None:
        st = self._reqs.pop(request_id)
        assert st.notifying
        if st.aborted:
            self._failed.append((request_id, st.failure or "aborted"))
        elif error is not None:
            self._failed.append((request_id, error))
        self._sent.append(request_id)

    def _maybe_complete(self, request_id: str) -> list[NotifJob]:
        st = self._reqs[request_id]
        if not st.finished or st.inflight or st.notifying:
            return []
        if st.aborted and st.dest.notif:
            st.notifying = True
            return [NotifJob(request_id, st.dest.peer,
                             encode(st.dest.notif, NoticeKind.ABORTED), st.incarnation)]
        if st.failure is not None:
            del self._reqs[request_id]
            self._failed.append((request_id, st.failure))
            self._sent.append(request_id)
            return []
        st.notifying = True
        return [NotifJob(request_id, st.dest.peer, encode(st.dest.notif, NoticeKind.DONE),
                         st.incarnation)]

    def take(self) -> SendOutcome:
        out = SendOutcome(self._sent, self._failed)
        self._sent, self._failed = [], []
        return out

    def has_pending(self) -> bool:
        """Whether an event will come without the engine doing anything (writes in flight, or a
        finished request still being delivered)."""
        return any(st.inflight or st.finished for st in self._reqs.values())

    def num_tracked(self) -> int:
        return len(self._reqs)


@dataclass
class Awaiting:
    """A prefill that finished before its destination was named: its blocks, kept."""

    params: PendingDestination
    block_table: list  # ``Sending.local_table``
    num_prompt_tokens: int


@dataclass
class PeerWrites:
    """This step's blocks for one peer incarnation, all requests together: one write per
    layer."""

    local: list = field(default_factory=list)  # block ids, or pages per group (hybrid KV)
    remote: list = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    needs: list[int] = field(default_factory=list)  # each pair's ``kv_window.block_needs``


MAX_FENCED = 65536  # fenced notifications remembered (a late Prefill comes within seconds)


class BoundedSet:
    """The ``limit`` most recently added items (a sender's fenced notifications)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[bytes, None] = OrderedDict()

    def add(self, item: bytes) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        return item in self._items
