"""The NIXL notification a sender ends a transfer with: a small typed, versioned payload.

A transfer is named by a *key* (opaque bytes the receiver chose: ``KVExpectation.notif``, sent
to the prefill worker as ``KVDestination.notif``). When every write of a request has landed the
sender notifies ``DONE``; when the request was aborted after writes may have been posted, it
notifies ``ABORTED`` once its last write has ended, so the receiver can reuse the blocks. On the
wire:

    b"KVN" | version (1 byte) | kind (1 byte) | key

A receiver drops (and counts) a message with another magic, an unknown version or kind: a peer
of another protocol is refused, never half-understood. The key of a decode lease is the request
id and the lease id, length-prefixed (:func:`lease_key`), so neither needs a separator that an id
could contain.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

MAGIC = b"KVN"
VERSION = 1
_HEAD = len(MAGIC) + 2


class NoticeKind(enum.IntEnum):
    DONE = 1  # every write of the request has landed: its KV is complete
    ABORTED = 2  # the sender gave the request up; its last write has ended


class Notice(NamedTuple):
    key: bytes
    kind: NoticeKind


class NoticeError(ValueError):
    """A notification this receiver cannot read (another protocol, version or kind)."""


def encode(key: bytes, kind: NoticeKind) -> bytes:
    if not key:
        raise ValueError("a notice needs a non-empty key")
    return MAGIC + bytes((VERSION, int(kind))) + key


def decode(msg: bytes) -> Notice:
    if len(msg) <= _HEAD or not msg.startswith(MAGIC):
        raise NoticeError(f"not a kvrelay KV notice ({msg[:16]!r})")
    version, kind = msg[len(MAGIC)], msg[len(MAGIC) + 1]
    if version != VERSION:
        raise NoticeError(f"KV notice version {version}, this receiver reads {VERSION}")
    try:
        return Notice(msg[_HEAD:], NoticeKind(kind))
    except ValueError as e:
        raise NoticeError(f"unknown KV notice kind {kind}") from e


def lease_key(request_id: str, lease_id: str) -> bytes:
    """The key of a decode worker's lease: request id and lease id, so a late notice of an
    earlier lease of the same request id is never taken for this one."""
    rid = request_id.encode()
    return struct.pack("<H", len(rid)) + rid + lease_id.encode()


def lease_of(key: bytes) -> str:
    """The lease id in a :func:`lease_key` key."""
    (n,) = struct.unpack_from("<H", key)
    return key[2 + n:].decode(errors="replace")
