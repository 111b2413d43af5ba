"""Per-request bookkeeping of both sides of a KV handoff: pure Python, no I/O, not thread-safe
(the connector serialises calls with its lock).

Sender (``SendTracker``), per request: which blocks are already covered, how many writes are in
flight, whether the engine finished it, whether something failed. The notification is released
(as a ``NotifJob`` for the I/O side to send) exactly once: when the request is finished, nothing is
in flight and nothing failed. A failed or aborted request is never notified as complete; it is
reported in ``failed`` and then in ``sent`` once no write reads its blocks anymore. An aborted one
whose peer is still reachable gets an *abort notice* instead (its notification + ``ABORT_SUFFIX``),
sent after its last write ended, so the receiver may reuse the blocks at once rather than after
its grace period.

Receiver (``RecvTracker``): open expectations keyed by notification bytes, with deadlines.
``Quarantine``: blocks of receivers aborted before their KV arrived, held until their sender's
last notification (abort notice or completion) says no write of it can still land there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from kvrelay.kv_transfer.messages import KVDestination
from kvrelay.kv_transfer.send_plan import PlanError, blocks_to_send, map_blocks

logger = logging.getLogger(__name__)


ABORT_SUFFIX = b"|abort"


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
        return PlannedWrite(bm.local, bm.remote, st.incarnation) if bm.local else None

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
            return [NotifJob(request_id, st.dest.peer, st.dest.notif + ABORT_SUFFIX,
                             st.incarnation)]
        if st.failure is not None:
            del self._reqs[request_id]
            self._failed.append((request_id, st.failure))
            self._sent.append(request_id)
            return []
        st.notifying = True
        return [NotifJob(request_id, st.dest.peer, st.dest.notif, st.incarnation)]

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


class RecvOutcome(NamedTuple):
    received: list[str]
    failed: list[tuple[str, str]]


class _Expect(NamedTuple):
    request_id: str
    deadline: float | None


class RecvTracker:
    def __init__(self) -> None:
        self._by_notif: dict[bytes, _Expect] = {}
        self._notif_of: dict[str, bytes] = {}
        self._received: list[str] = []
        self._failed: list[tuple[str, str]] = []

    def expect(self, request_id: str, notif: bytes, deadline: float | None) -> None:
        other = self._by_notif.get(notif)
        if other is not None and other.request_id != request_id:
            raise ValueError(f"notification {notif!r} of {request_id!r} is already expected by "
                             f"{other.request_id!r}: notifications must be unique per request")
        self.forget(request_id)
        self._by_notif[notif] = _Expect(request_id, deadline)
        self._notif_of[request_id] = notif

    def forget(self, request_id: str) -> bool:
        notif = self._notif_of.pop(request_id, None)
        if notif is None:
            return False
        del self._by_notif[notif]
        return True

    def on_notif(self, peer: str, msg: bytes) -> None:
        exp = self._by_notif.pop(msg, None)
        if exp is None:
            logger.debug("dropping notification %r from %s: no request expects it", msg, peer)
            return
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


class Quarantine:
    """Aborted receivers whose blocks a sender may still write: request -> release time, and
    their notification -> request. The sender's final notification ends the hold whichever it
    is: an abort notice, or the completion of a send that finished before its abort reached
    it (its writes have all ended either way). The release time is only a backstop."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._by_notif: dict[bytes, str] = {}

    def __bool__(self) -> bool:
        return bool(self._until)

    def hold(self, request_id: str, notif: bytes, until: float) -> None:
        self._until[request_id] = until
        self._by_notif[notif] = request_id

    def on_notif(self, msg: bytes) -> bool:
        """Whether ``msg`` was the last word of a held request's sender (it is consumed)."""
        base = msg[:-len(ABORT_SUFFIX)] if msg.endswith(ABORT_SUFFIX) else msg
        rid = self._by_notif.pop(base, None)
        if rid is None:
            return msg.endswith(ABORT_SUFFIX)  # a late notice: nothing to release
        self._until[rid] = 0.0
        return True

    def release_due(self, now: float) -> list[str]:
        due = [r for r, t in self._until.items() if t <= now]
        if due:
            for r in due:
                del self._until[r]
            gone = set(due)
            self._by_notif = {k: v for k, v in self._by_notif.items() if v not in gone}
        return due
