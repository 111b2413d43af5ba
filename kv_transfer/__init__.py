"""KV data plane: move an engine's KV blocks to a peer engine over NIXL.

Importable without NIXL: ``errors``, ``layout``, ``messages``, ``send_plan``, ``tracker``,
``transport_types``. Needs NIXL (ImportError with install advice otherwise): ``nixl_transport``,
``transfer_thread``, ``sending``, ``connector``.

    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVDestination, KVExpectation, PeerInfo
"""

from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import IncompatibleKVLayout, KVLayout, check_compatible
from kvrelay.kv_transfer.messages import KVDestination, KVExpectation, PeerInfo

__all__ = [
    "IncompatibleKVLayout",
    "KVDestination",
    "KVExpectation",
    "KVLayout",
    "KVTransferError",
    "PeerInfo",
    "check_compatible",
]
