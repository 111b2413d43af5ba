"""Messages of the KV data plane: what the control plane hands the connector, and back.

- ``KVDestination`` (prefill side, ``Sequence.kv_transfer_params``): where this request's KV goes.
- ``KVExpectation`` (decode side, ``Sequence.kv_transfer_params``): which notification says the
  request's KV has fully arrived.
- ``PeerInfo``: everything a sender needs to write into an engine's KV tensor. It travels over
  our own control channel (gRPC) as opaque, versioned bytes (``to_bytes``/``from_bytes``).
"""

from __future__ import annotations

import base64
import json
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrelay.kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class KVDestination:
    """Send the request's prompt KV to agent ``peer``.

    ``remote_block_ids[i]`` is the peer's block for the request's i-th block (the peer's whole
    reservation, cached prefix included); the first ``skip_blocks`` are already there (the peer's
    prefix cache) and are never written. ``notif`` is sent once after all data has landed.
    ``incarnation`` is the peer's ``PeerInfo.incarnation`` when it reserved the blocks: writes
    are refused if the peer restarted since (its blocks now belong to someone else). When None,
    the request binds to the incarnation known at its first step.

    ``remote_pages`` (a peer under the hybrid KV layout, ``engine/hybrid_kv.py``): per block,
    the peer's page of each layer group (-1: none, where no layer of the group reads the block
    from the handoff on); the writes address these, not the block ids.
    """

    peer: str
    remote_block_ids: Sequence[int]
    skip_blocks: int = 0
    notif: bytes = b""
    incarnation: str | None = None
    remote_pages: Sequence[Sequence[int]] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "remote_block_ids", tuple(int(b) for b in self.remote_block_ids))
        object.__setattr__(self, "remote_pages",
                           tuple(tuple(int(p) for p in b) for b in self.remote_pages))
        if self.remote_pages and (len(self.remote_pages) != len(self.remote_block_ids) or
                                  len({len(b) for b in self.remote_pages}) != 1):
            raise ValueError(f"KVDestination.remote_pages must name as many pages for each of "
                             f"the {len(self.remote_block_ids)} blocks, got "
                             f"{[len(b) for b in self.remote_pages]}")
        if not self.peer:
            raise ValueError("KVDestination.peer must name the receiving NIXL agent")
        if any(b < 0 for b in self.remote_block_ids):
            raise ValueError(f"KVDestination.remote_block_ids must be >= 0, got "
                             f"{list(self.remote_block_ids)}")
        if not 0 <= self.skip_blocks <= len(self.remote_block_ids):
            raise ValueError(f"KVDestination.skip_blocks must be in [0, "
                             f"{len(self.remote_block_ids)}], got {self.skip_blocks}")
        if isinstance(self.notif, str):
            object.__setattr__(self, "notif", self.notif.encode())
        if not self.notif:
            raise ValueError("KVDestination.notif must be non-empty: the receiver matches on it")


class PendingDestination:
    """A prefill started before its destination is known (the router reserves the decode
    worker's blocks while this worker already computes): ``resolve`` names it later, from any
    thread. Until then nothing is written; blocks computed meanwhile go out once it is known
    (all layers at once), and a request that finished first keeps its blocks until then.
    ``close`` (the request ended without a destination) makes a later ``resolve`` fail."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dest: KVDestination | None = None
        self._closed = False

    @property
    def dest(self) -> KVDestination | None:
        return self._dest

    @property
    def closed(self) -> bool:
        """Ended unresolved: no destination will ever be named."""
        return self._closed and self._dest is None

    def resolve(self, dest: KVDestination) -> bool:
        """False: already resolved, or the request is gone."""
        with self._lock:
            if self._dest is not None or self._closed:
                return False
            self._dest = dest
            return True

    def close(self) -> bool:
        """End it unresolved; False when it was resolved first (the request sends then)."""
        with self._lock:
            self._closed = True
            return self._dest is None


def remote_table(dest: KVDestination) -> Sequence[int] | Sequence[Sequence[int]]:
    """What the sender's plan pairs with its own blocks: the peer's pages per group of each
    block under the hybrid layout, else its block ids."""
    return dest.remote_pages or dest.remote_block_ids


def destination_of(params: object) -> KVDestination | None:
    """The destination a prefill request's ``kv_transfer_params`` names now (None: not a
    sending request, or not known yet)."""
    if isinstance(params, KVDestination):
        return params
    return params.dest if isinstance(params, PendingDestination) else None


@dataclass(frozen=True)
class KVExpectation:
    """The request's KV is complete when notification ``notif`` arrives (within ``timeout_s``)
    from agent ``sender``, the prefill worker the blocks were promised to (None: any sender;
    ``NixlConnector.bind_sender`` names it later, e.g. when a prefill is retried elsewhere)."""

    notif: bytes
    timeout_s: float | None = None
    sender: str | None = None
    # The sender's control address: where to ask whether it is done, should we give up first.
    sender_address: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.notif, str):
            object.__setattr__(self, "notif", self.notif.encode())
        if not self.notif:
            raise ValueError("KVExpectation.notif must be non-empty")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"KVExpectation.timeout_s must be positive, got {self.timeout_s}")


_MAGIC = b"KVRP"
_WIRE_VERSION = 2  # 2: rank_agents
_HEAD = struct.Struct("!4sBI")  # magic, wire version, length of the JSON part


@dataclass(frozen=True)
class RankAgent:
    """The NIXL agent of one of an engine's tensor-parallel ranks 1..N-1, in that rank's process
    (rank 0's is the ``PeerInfo``'s own): its metadata, its device, and the transport ranks
    (``KVLayout.head_ranges`` indices: KV head groups make several per process) whose KV it
    holds, at ``PeerInfo.rank_addresses`` in its own address space."""

    name: str
    metadata: bytes
    device_id: int
    slots: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "metadata": base64.b64encode(self.metadata).decode(),
                "device_id": self.device_id, "slots": list(self.slots)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankAgent:
        return cls(str(d["name"]), base64.b64decode(d["metadata"]), int(d["device_id"]),
                   tuple(int(s) for s in d["slots"]))


@dataclass(frozen=True)
class PeerInfo:
    """One engine's KV endpoint. ``incarnation`` changes on every process start, so a restarted
    peer that kept its agent name is recognised and reconnected.

    Under tensor parallelism every rank registers its own KV with its own NIXL agent (GPU memory
    cannot be registered by another process's agent; vLLM's connector runs one per rank for the
    same reason): ``rank_agents`` names ranks 1..N-1's, each with the transport ranks it holds;
    the transport ranks no agent claims are this agent's. A sender writes each of them from the
    rank of its own that holds the heads (``NixlTransport``), and only this agent notifies."""

    agent_name: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata()
    layout: KVLayout
    base_address: int  # data_ptr() of the registered KV tensor
    device_id: int
    incarnation: str
    # data_ptr() of every tensor-parallel rank's KV tensor (``layout.head_ranges`` order);
    # () means ``(base_address,)``.
    rank_addresses: tuple[int, ...] = ()
    rank_agents: tuple[RankAgent, ...] = ()

    def __post_init__(self) -> None:
        if not self.agent_name:
            raise ValueError("PeerInfo.agent_name must be non-empty")
        if not self.agent_metadata:
            raise ValueError("PeerInfo.agent_metadata must be non-empty")
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"PeerInfo.layout must be a KVLayout, got {type(self.layout)}")
        if self.base_address <= 0 or self.device_id < 0:
            raise ValueError(f"PeerInfo has an invalid address {self.base_address:#x} "
                             f"or device id {self.device_id}")
        if not self.incarnation:
            raise ValueError("PeerInfo.incarnation must be non-empty")
        if not self.rank_addresses:
            object.__setattr__(self, "rank_addresses", (self.base_address,))
        object.__setattr__(self, "rank_addresses", tuple(int(a) for a in self.rank_addresses))
        if len(self.rank_addresses) != self.layout.tp_size or min(self.rank_addresses) <= 0:
            raise ValueError(f"PeerInfo has {len(self.rank_addresses)} rank addresses for "
                             f"{self.layout.tp_size} tensor-parallel ranks")
        claimed = [s for a in self.rank_agents for s in a.slots]
        if len(set(claimed)) != len(claimed) or any(
                not 0 <= s < self.layout.tp_size for s in claimed):
            raise ValueError(f"PeerInfo's rank agents claim transport ranks {claimed} of "
                             f"{self.layout.tp_size}: each at most once")
        if any(a.name == self.agent_name or not a.metadata for a in self.rank_agents):
            raise ValueError("a PeerInfo rank agent needs its own name and metadata")

    def agent_of(self, slot: int) -> tuple[str, int]:
        """(agent name, device id) holding transport rank ``slot``'s KV."""
        for a in self.rank_agents:
            if slot in a.slots:
                return a.name, a.device_id
        return self.agent_name, self.device_id

    def agent_metadata_of(self, name: str) -> bytes:
        if name == self.agent_name:
            return self.agent_metadata
        return next(a.metadata for a in self.rank_agents if a.name == name)

    def _header(self) -> dict[str, Any]:
        return {"agent_name": self.agent_name, "layout": self.layout.to_dict(),
                "base_address": self.base_address, "device_id": self.device_id,
                "incarnation": self.incarnation, "rank_addresses": list(self.rank_addresses),
                "rank_agents": [a.to_dict() for a in self.rank_agents]}

    def to_bytes(self) -> bytes:
        """``KVRP`` + wire version + JSON header length, the JSON header, the NIXL metadata."""
        head = json.dumps(self._header(), sort_keys=True, separators=(",", ":")).encode()
        return _HEAD.pack(_MAGIC, _WIRE_VERSION, len(head)) + head + self.agent_metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerInfo:
        data = bytes(data)
        if len(data) < _HEAD.size or data[:4] != _MAGIC:
            raise ValueError("not a kvrelay PeerInfo (bad magic): is the peer a kvrelay worker?")
        _, version, n = _HEAD.unpack_from(data)
        if version != _WIRE_VERSION:
            raise ValueError(f"PeerInfo wire version {version}, we read {_WIRE_VERSION}: run the "
                             "same kvrelay version in both pools")
        if len(data) < _HEAD.size + n:
            raise ValueError("truncated PeerInfo")
        head = json.loads(data[_HEAD.size:_HEAD.size + n])
        return cls(agent_name=head["agent_name"],
                   agent_metadata=data[_HEAD.size + n:],
                   layout=KVLayout.from_dict(head["layout"]),
                   base_address=int(head["base_address"]), device_id=int(head["device_id"]),
                   incarnation=head["incarnation"],
                   rank_addresses=tuple(head.get("rank_addresses", ())),
                   rank_agents=tuple(RankAgent.from_dict(a) for a in head.get("rank_agents", ())))
