"""The KV notification's wire form (kv_transfer/notice.py): typed, versioned, refused whole
when unreadable; and the lease key, read back without a separator an id could contain."""

from __future__ import annotations

import pytest

from kvrelay.kv_transfer.notice import (
    MAGIC,
    VERSION,
    Notice,
    NoticeError,
    NoticeKind,
    decode,
    encode,
    lease_key,
    lease_of,
)
from kvrelay.kv_transfer.receiving import Receiving
from kvrelay.kv_transfer.transport_types import Notification


@pytest.mark.parametrize("kind", list(NoticeKind))
def test_round_trip(kind: NoticeKind) -> None:
    key = lease_key("req|with|bars", "lease-1")
    assert decode(encode(key, kind)) == Notice(key, kind)
    assert lease_of(key) == "lease-1"


@pytest.mark.parametrize("msg", [
    b"", b"KVN", b"rid|lease", b"rid|lease|abort",  # the protocol before this one
    MAGIC + bytes((VERSION + 1, 1)) + b"k",  # a newer version
    MAGIC + bytes((VERSION, 9)) + b"k",  # an unknown kind
])
def test_unreadable_notices_are_refused(msg: bytes) -> None:
    with pytest.raises(NoticeError):
        decode(msg)


def test_a_receiver_drops_and_counts_what_it_cannot_read() -> None:
    rx = Receiving(sender_gone_grace_s=1.0, quarantine_backstop_s=10.0)
    outcome, released = rx.take([Notification("p1", b"rid|lease"),
                                 Notification("p1", MAGIC + bytes((VERSION + 1, 1)) + b"k")])
    assert rx.counters()["unreadable_notif"] == 2
    assert not outcome.received and released == []
