"""A worker's KV endpoint: the NIXL connector plus what the gRPC servicers need of it.

The decode servicer publishes ``peer_info_bytes()`` (GetTransferInfo) and registers an
expectation per lease; the prefill servicer adds peers by their published bytes and builds a
destination per request. The notification names both the request and its lease, so a late
notification from an earlier lease of the same request id is never taken for this one.
"""

from __future__ import annotations

from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
from kvrelay.kv_transfer.layout import model_identity
from kvrelay.kv_transfer.messages import KVDestination, KVExpectation, PeerInfo
from kvrelay.kv_transfer.notice import lease_key


def notif_for(request_id: str, lease_id: str) -> bytes:
    return lease_key(request_id, lease_id)


class KVEndpoint:
    def __init__(self, agent_name: str, model_dir: str, *, kv_timeout_s: float | None = None,
                 sender_gone_grace_s: float | None = None, layerwise: str = "auto"):
        self.agent_name = agent_name
        self.kv_timeout_s = kv_timeout_s
        grace = {} if sender_gone_grace_s is None else {"sender_gone_grace_s": sender_gone_grace_s}
        self.connector = NixlConnector(NixlConnectorConfig(agent_name, model_identity(model_dir),
                                                           layerwise=layerwise, **grace))
        self._spec: KVCacheSpec | None = None

    def bind(self, spec: KVCacheSpec) -> None:
        self._spec = spec

    @property
    def incarnation(self) -> str:
        return self.connector.peer_info().incarnation

    # -- receiving side (decode) ---------------------------------------------------------------
    def peer_info_bytes(self) -> bytes:
        return self.connector.peer_info().to_bytes()

    def expectation(self, request_id: str, lease_id: str, sender: str = "",
                    sender_address: str = "") -> KVExpectation:
        return KVExpectation(notif_for(request_id, lease_id), self.kv_timeout_s, sender or None,
                             sender_address or None)

    def bind_sender(self, request_id: str, sender: str, sender_address: str = "") -> bool:
        return self.connector.bind_sender(request_id, sender, sender_address or None)

    def settle(self, request_id: str) -> bool:
        return self.connector.settle(request_id)

    def observe_alive(self, senders: set[str]) -> None:
        self.connector.observe_alive(senders)

    # -- sending side (prefill) ----------------------------------------------------------------
    def fence(self, request_id: str, lease_id: str) -> bytes:
        """Nothing is written under this lease from now on (engine thread); its notification."""
        notif = notif_for(request_id, lease_id)
        self.connector.fence(notif)
        return notif

    def is_fenced(self, request_id: str, lease_id: str) -> bool:
        return self.connector.is_fenced(notif_for(request_id, lease_id))

    def still_sending(self, request_id: str) -> bool:
        return self.connector.still_sending(request_id)

    def is_fenced_notif(self, notif: bytes) -> bool:
        return self.connector.is_fenced(notif)

    def destination_ready(self, request_id: str) -> None:
        self.connector.destination_ready(request_id)

    def abandon(self, request_id: str) -> bool:
        return self.connector.abandon(request_id)

    def has_peer(self, agent_name: str, incarnation: str) -> bool:
        return self.connector.peer_incarnation(agent_name) == incarnation

    def add_peer(self, peer_info: bytes) -> None:
        self.connector.add_peer(PeerInfo.from_bytes(peer_info))

    def evict_peer(self, agent_name: str) -> bool:
        """Forget a decode worker: its remote agent, descriptors and connection."""
        return self.connector.evict_peer(agent_name)

    def destination(self, request_id: str, agent_name: str, block_ids: list[int],
                    skip_blocks: int, lease_id: str, incarnation: str) -> KVDestination:
        # The incarnation binds the writes to the process that granted the lease: if the decode
        # worker restarted under the same name since, the transfer fails instead of writing
        # into a stranger's blocks.
        return KVDestination(agent_name, block_ids, skip_blocks, notif_for(request_id, lease_id),
                             incarnation=incarnation or None)

    def block_bytes(self) -> int:
        """Bytes one block costs across all layers, K and V."""
        assert self._spec is not None
        return self._spec.bytes_per_block_all_layers
