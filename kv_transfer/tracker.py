"""Per-request bookkeeping of both sides of a KV handoff: pure Python, no I/O, not thread-safe
(the connector serialises calls with its lock).

Sender (``SendTracker``), per request: which blocks are already covered, how many writes are in
flight, whether the engine finished it, whether something failed. The notification is released
(as a ``NotifJob`` for the I/O side to send) exactly once: when the request is finished, nothing is
in flight and nothing failed. A failed or aborted request is never notified as complete; it is
reported in ``failed`` and then in ``sent`` once no write reads its blocks anymore. An aborted one
whose peer is still reachable gets an *abort notice* instead (an ``ABORTED`` notice, ``notice.py``),
sent after its last write ended, so the receiver may reuse the blocks at once rather than after
its grace period.

Receiver (``RecvTracker``): open expectations keyed by notification bytes, with deadlines, each
bound to the agent its KV was promised to: a notification from any other agent is dropped.
``Quarantine``: blocks of receivers aborted before their KV arrived, held until their sender is
known to be done (its last notification, the control plane's word, or its departure).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvrelay.kv_transfer.messages import KVDestination, PendingDestination
from kvrelay.kv_transfer.notice import Notice, NoticeKind, encode
from kvrelay.kv_transfer.send_plan import PlanError, blocks_to_send, map_blocks

logger = logging.getLogger(__name__)




class NotifJob(NamedTuple):
    request_id: str
    peer: str
    notif: bytes
    incarnation: str | None  # of the peer the request's writes went to


class PlannedWrite(NamedTuple):
    """A request's blocks for this step, bound to one incarnation of its peer."""

    local: list[int]
    remote: list[int]
    incarnation: str | None


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

    def plan(self, request_id: str, dest: KVDestination, block_table: list[int],
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
            bm = map_blocks(block_table, dest.remote_block_ids, rng)
        except PlanError as e:
            st.failure = str(e)
            return None
        st.covered = rng.covered
        st.sent_tokens = max(st.sent_tokens, min(start_token + num_new_tokens, num_prompt_tokens))
        return PlannedWrite(bm.local, bm.remote, st.incarnation) if bm.local else None

    def catch_up(self, request_id: str, dest: KVDestination, block_table: list[int],
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
    block_table: list[int]
    num_prompt_tokens: int


@dataclass
class PeerWrites:
    """This step's blocks for one peer incarnation, all requests together: one write per
    layer."""

    local: list[int] = field(default_factory=list)
    remote: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


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


class RecvOutcome(NamedTuple):
    received: list[str]
    failed: list[tuple[str, str]]


class _Expect(NamedTuple):
    request_id: str
    deadline: float | None
    sender: str | None  # the only agent whose notification completes it (None: any)
    sender_address: str | None = None  # its control address (to fence the transfer)


class RecvTracker:
    def __init__(self) -> None:
        self._by_notif: dict[bytes, _Expect] = {}
        self._notif_of: dict[str, bytes] = {}
        self._received: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self.num_foreign = 0  # notifications of an expected transfer from another agent

    def expect(self, request_id: str, notif: bytes, deadline: float | None,
               sender: str | None = None, sender_address: str | None = None) -> None:
        other = self._by_notif.get(notif)
        if other is not None and other.request_id != request_id:
            raise ValueError(f"notification {notif!r} of {request_id!r} is already expected by "
                             f"{other.request_id!r}: notifications must be unique per request")
        self.forget(request_id)
        self._by_notif[notif] = _Expect(request_id, deadline, sender, sender_address)
        self._notif_of[request_id] = notif

    def bind(self, request_id: str, sender: str, sender_address: str | None = None) -> bool:
        """Promise the request's transfer to ``sender`` instead (False: nothing expected)."""
        notif = self._notif_of.get(request_id)
        if notif is None:
            return False
        self._by_notif[notif] = self._by_notif[notif]._replace(sender=sender,
                                                               sender_address=sender_address)
        return True

    def forget(self, request_id: str) -> _Expect | None:
        notif = self._notif_of.pop(request_id, None)
        if notif is None:
            return None
        return self._by_notif.pop(notif)

    def on_notif(self, peer: str, msg: bytes) -> None:
        """A ``DONE`` notice's key (``msg``) from ``peer``."""
        exp = self._by_notif.get(msg)
        if exp is None:
            logger.debug("dropping notification %r from %s: no request expects it", msg, peer)
            return
        if exp.sender is not None and peer != exp.sender:
            self.num_foreign += 1
            logger.warning("dropping notification of %s from %s: its KV was promised to %s",
                           exp.request_id, peer, exp.sender)
            return
        del self._by_notif[msg]
        del self._notif_of[exp.request_id]
        self._received.append(exp.request_id)

    def expire(self, now: float) -> None:
        late = [e for e in self._by_notif.values() if e.deadline is not None and e.deadline <= now]
        for e in late:
            self.forget(e.request_id)
            self._failed.append((e.request_id, "KV did not arrive before the deadline"))

    def take(self) -> RecvOutcome:
        out = RecvOutcome(self._received, self._failed)
        self._received, self._failed = [], []
        return out

    def has_pending(self) -> bool:
        return bool(self._notif_of)


class _Held(NamedTuple):
    notif: bytes
    sender: str | None
    sender_address: str | None
    backstop: float  # released then whatever happened, with a warning


class Quarantine:
    """Blocks of receivers aborted before their KV arrived, which their sender may still write.

    A hold ends when the sender is known to be done, never after a fixed delay:
    - its final notification from the sender it was promised to (an abort notice, or the
      completion of a send that finished before the abort reached it: either way, no write of
      it is left);
    - ``settle``: the control plane knows no write was started or is still running (the router
      never dispatched the prefill, or every dispatch ended without writing; or the sender,
      asked, fenced the transfer and had nothing of it in flight);
    - ``observe_alive``: the sender has been gone for a grace period (no router lists it);
    - the backstop, far beyond any write timeout, only if none of these ever comes.
    """

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._by_notif: dict[bytes, str] = {}
        self._due: list[str] = []
        self._absent_since: dict[str, float] = {}
        self.num_foreign = 0
        self.ended: Counter[str] = Counter()  # holds ended, by what ended them

    def __bool__(self) -> bool:
        return bool(self._held) or bool(self._due)

    def hold(self, request_id: str, notif: bytes, sender: str | None, backstop: float,
             sender_address: str | None = None) -> None:
        self._held[request_id] = _Held(notif, sender, sender_address, backstop)
        self._by_notif[notif] = request_id

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_backstopped(self) -> int:
        return self.ended["backstop"]

    def _release(self, request_id: str, why: str) -> None:
        self.ended[why] += 1
        held = self._held.pop(request_id)
        del self._by_notif[held.notif]
        self._due.append(request_id)

    def on_notif(self, peer: str, notice: Notice) -> bool:
        """Whether ``notice`` was meant for a held request (it is consumed)."""
        rid = self._by_notif.get(notice.key)
        if rid is None:
            return notice.kind is NoticeKind.ABORTED  # a late notice: nothing to release
        sender = self._held[rid].sender
        if sender is not None and peer != sender:
            self.num_foreign += 1
            logger.warning("ignoring %s %r from %s: the blocks of %s were promised to %s",
                           notice.kind.name, notice.key, peer, rid, sender)
            return True
        self._release(rid, "notice")
        return True

    def settle(self, request_id: str) -> bool:
        if request_id not in self._held:
            return False
        self._release(request_id, "settled")
        return True

    def observe_alive(self, alive: set[str], now: float, grace_s: float) -> None:
        """Release the holds of senders absent from ``alive`` for ``grace_s`` or longer."""
        senders = {h.sender for h in self._held.values() if h.sender is not None}
        self._absent_since = {s: self._absent_since.get(s, now) for s in senders - alive}
        gone = {s for s, t in self._absent_since.items() if now - t >= grace_s}
        for rid in [r for r, h in self._held.items() if h.sender in gone]:
            logger.info("releasing %s's blocks: its sender %s is gone", rid,
                        self._held[rid].sender)
            self._release(rid, "sender_gone")

    def release_due(self, now: float) -> list[str]:
        for rid in [r for r, h in self._held.items() if h.backstop <= now]:
            logger.warning("releasing %s's blocks after the backstop: its sender %s never said "
                           "its writes ended", rid, self._held[rid].sender or "(unbound)")
            self._release(rid, "backstop")
        due, self._due = self._due, []
        return due
