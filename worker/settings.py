"""How one worker process is configured (``kvrelay worker``'s flags read their defaults here).

No torch, no engine: the command line and the deploy tools read it before a worker exists."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvrelay.common.rpc import DRAIN_TIMEOUT_S, HEARTBEAT_INTERVAL_S, LEASE_TTL_S

ROLES = ("prefill", "decode", "both")
KV_LAYERWISE = ("auto", "on", "off")  # NixlConnectorConfig.layerwise's (that module loads torch)


@dataclass(frozen=True)
class WorkerSettings:
    role: str
    routers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    worker_id: str | None = None
    cluster_token: str | None = None
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    lease_ttl_s: float = LEASE_TTL_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    # Blocks promised to a prefill worker that no router lists any more are reused this long
    # after it left (its writes time out by then). None: the connector's default
    # (kv_transfer.config.NixlConnectorConfig.sender_gone_grace_s, 10 s).
    kv_sender_grace_s: float | None = None
    # A prefill worker's KV: layer by layer, whole per step, or "auto" (NixlConnectorConfig)
    kv_layerwise: str = "auto"
    metrics_port: int | None = None  # Prometheus /metrics over HTTP when set (0 = any free)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry spans to this collector when set

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {self.role!r}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.heartbeat_interval_s <= 0 or self.lease_ttl_s <= 0:
            raise ValueError("heartbeat_interval_s and lease_ttl_s must be positive")
        if self.kv_sender_grace_s is not None and self.kv_sender_grace_s < 0:
            raise ValueError("kv_sender_grace_s must be >= 0")
        if self.kv_layerwise not in KV_LAYERWISE:
            raise ValueError(f"kv_layerwise must be one of {KV_LAYERWISE}, got "
                             f"{self.kv_layerwise!r}")

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    def advertised(self, port: int) -> str:
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
