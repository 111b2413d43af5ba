"""The receiver's bookkeeping of KV handoffs: pure Python, no I/O, not thread-safe (the
connector serialises calls with its lock).

``RecvTracker``: open expectations keyed by notification bytes, with deadlines, each bound to the
agent its KV was promised to: a notification from any other agent is dropped. ``Quarantine``:
blocks of receivers aborted before their KV arrived, held until their sender is known to be done
(its last notification, the control plane's word, or its departure). The sender's side is
``send_tracker.py``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple

from kvrelay.kv_transfer.notice import Notice, NoticeKind

logger = logging.getLogger(__name__)


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

    def observe_alive(self, alive: set[str], now: float, grace_s: float,
                      continuous: bool = True) -> None:
        """Release the holds of senders absent from ``alive`` for ``grace_s`` or longer.
        ``continuous`` False: the observations before this one may have missed a time the
        sender was listed (a router did not answer for a while), so absence restarts now."""
        if not continuous:
            self._absent_since.clear()
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
