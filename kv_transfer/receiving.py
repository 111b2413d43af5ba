"""The receiving side of ``NixlConnector`` (decode engine): expectations and held blocks.

A reserved request waits for one notification, from the prefill worker its KV was promised to
(``RecvTracker``). A request aborted before its KV arrived keeps its blocks until its sender is
known to be done (``Quarantine``); ``on_hold`` tells the worker, which asks the sender to fence
the transfer. Thread-safe: the engine thread and the worker's event loop both call in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvrelay.engine.sequence import FinishReason
from kvrelay.kv_transfer.messages import KVExpectation
from kvrelay.kv_transfer.nixl_transport import Notification
from kvrelay.kv_transfer.notice import NoticeError, NoticeKind, decode
from kvrelay.kv_transfer.recv_tracker import Quarantine, RecvOutcome, RecvTracker

if TYPE_CHECKING:
    from kvrelay.engine.sequence import Sequence

_ABORTED = (FinishReason.ABORT, FinishReason.ERROR)

# (request id, notification, sender, its control address) of a new hold
OnHold = Callable[[str, bytes, "str | None", "str | None"], None]

logger = logging.getLogger(__name__)


class Receiving:
    def __init__(self, sender_gone_grace_s: float, quarantine_backstop_s: float) -> None:
        self._lock = threading.Lock()
        self._recv = RecvTracker()
        self._quarantine = Quarantine()
        self.sender_gone_grace_s = sender_gone_grace_s
        self.quarantine_backstop_s = quarantine_backstop_s
        self.on_hold: OnHold | None = None
        self.num_unreadable = 0  # notifications of another protocol, version or kind

    def expect(self, seq: Sequence) -> None:
        exp = seq.kv_transfer_params
        if not isinstance(exp, KVExpectation):
            raise TypeError(f"request {seq.request_id!r} waits for KV but its kv_transfer_params "
                            f"is {type(exp).__name__}, not KVExpectation")
        deadline = None if exp.timeout_s is None else time.monotonic() + exp.timeout_s
        with self._lock:
            self._recv.expect(seq.request_id, exp.notif, deadline, exp.sender,
                              exp.sender_address)

    def bind_sender(self, request_id: str, sender: str, sender_address: str | None) -> bool:
        with self._lock:
            return self._recv.bind(request_id, sender, sender_address)

    def settle(self, request_id: str) -> bool:
        with self._lock:
            return self._quarantine.settle(request_id)

    def observe_alive(self, senders: set[str], continuous: bool = True) -> None:
        with self._lock:
            self._quarantine.observe_alive(senders, time.monotonic(), self.sender_gone_grace_s,
                                           continuous)

    def finished(self, seq: Sequence, params: KVExpectation) -> bool:
        """The engine is done with a receiving request: True when its blocks must wait for its
        sender (it was aborted before its KV arrived)."""
        with self._lock:
            exp = self._recv.forget(seq.request_id)
            held = seq.finish_reason in _ABORTED and not seq.kv_ready
            sender, address = ((exp.sender, exp.sender_address) if exp is not None
                               else (params.sender, params.sender_address))
            if held:
                self._quarantine.hold(seq.request_id, params.notif, sender,
                                      time.monotonic() + self.quarantine_backstop_s, address)
        if held and self.on_hold is not None:
            self.on_hold(seq.request_id, params.notif, sender, address)
        return held

    def expecting(self) -> bool:
        """Whether notifications are awaited (only then is the transport polled for them)."""
        with self._lock:
            return self._recv.has_pending() or bool(self._quarantine)

    def take(self, notifs: Iterable[Notification]) -> tuple[RecvOutcome, list[str]]:
        """Route polled notifications; the requests whose KV arrived or failed, and the held
        ones whose blocks may be reused now."""
        now = time.monotonic()
        with self._lock:
            for n in notifs:
                try:
                    notice = decode(n.msg)
                except NoticeError as e:
                    self.num_unreadable += 1
                    logger.warning("dropping a notification from %s: %s", n.peer, e)
                    continue
                # A held request's sender has ended its last write: reuse the blocks now.
                if not self._quarantine.on_notif(n.peer, notice) \
                        and notice.kind is NoticeKind.DONE:
                    self._recv.on_notif(n.peer, notice.key)
            self._recv.expire(now)
            return self._recv.take(), self._quarantine.release_due(now)

    def counters(self) -> dict[str, int]:
        with self._lock:
            q = self._quarantine
            out = {f"hold_ended_{why}": n for why, n in q.ended.items()}
            out["foreign_notif"] = self._recv.num_foreign + q.num_foreign
            out["unreadable_notif"] = self.num_unreadable
            out["held"] = q.num_held
            return out
