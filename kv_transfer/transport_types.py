"""What ``NixlTransport`` hands out and keeps: the handle of a posted write, an incoming
notification, and the peer table's entries.

Plain records, apart from the transport so that the NIXL calls read without them. A
``WriteHandle``'s transfer handles (``_xfer``: one per peer agent it writes to) belong to the
transport that posted it: only that transport polls and releases them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from kvrelay.kv_transfer.layout import HeadRun
from kvrelay.kv_transfer.messages import PeerInfo


class Notification(NamedTuple):
    peer: str
    msg: bytes


class WriteHandle:
    """One posted transfer: a write into a peer's blocks, or (``op == "read"``) a read of a
    peer's blocks into ours (a prefix pull). ``poll`` it until it returns True (or raises)."""

    __slots__ = ("_xfer", "deadline", "done", "nbytes", "op", "peer", "posted_at", "staging")

    def __init__(self, peer: str, nbytes: int, xfers: list[object], deadline: float,
                 staging: int | None = None, op: str = "write") -> None:
        self.peer = peer
        self.op = op
        self.staging = staging  # offset of its staged bytes, freed when it finishes
        self.nbytes = nbytes
        self._xfer = xfers  # the NIXL transfers not yet done
        self.posted_at = time.monotonic()
        self.deadline = deadline
        self.done = not xfers

    def __repr__(self) -> str:
        return f"WriteHandle({self.op} {self.peer!r}, {self.nbytes} B, done={self.done})"


class PeerAgent(NamedTuple):
    """One of a peer's NIXL agents we write to (its main one or a rank's): the transport ranks
    it holds and their (layer, kv, block) regions, rank after rank, as one prepared list."""

    name: str
    slots: tuple[int, ...]
    dlist: object
    device_id: int

    def row(self, slot: int, per_slot: int) -> int:
        """The first row of ``slot``'s regions in ``dlist``."""
        return self.slots.index(slot) * per_slot


class PreparedPeer(NamedTuple):
    """A peer the transport may write to: its ``PeerInfo`` and its descriptors, prepared once."""

    info: PeerInfo
    dlist: object  # nixl_prepped_dlist_handle over the peer's (layer, kv, block) regions
    # The head runs our transport ranks write; None: one rank each side, whole blocks through
    # ``dlist``.
    runs: list[HeadRun] | None
    # Several ranks on a side: the peer's agents our runs write to or read from, by name.
    agents: dict[str, PeerAgent] | None = None
    # The head runs a read (prefix pull) moves into our transport ranks: ``src`` the peer's.
    read_runs: list[HeadRun] | None = None


def mem_type(device_kind: str) -> str:
    """NIXL's memory type of a KV tensor on ``device_kind``."""
    return "VRAM" if device_kind == "cuda" else "DRAM"
