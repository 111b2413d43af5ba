"""How one worker process is configured (``kvrelay worker``'s flags read their defaults here).

No torch, no engine: the command line and the deploy tools read it before a worker exists."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvrelay.common.kv_timing import check_kv_timing, kv_timing_defaults
from kvrelay.common.rpc import DRAIN_TIMEOUT_S, HEARTBEAT_INTERVAL_S, LEASE_TTL_S
from kvrelay.worker.watchdog import ENGINE_WATCHDOG_S

ROLES = ("prefill", "decode", "both")
KV_LAYERWISE = ("auto", "on", "off")  # NixlConnectorConfig.layerwise's (that module loads torch)
KV_EVENTS_ENCODINGS = ("map", "array")  # worker/kv_events_zmq.py's ENCODINGS (it loads ZMQ)


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
    # A prefill worker posts KV writes only this long after a router last answered its heartbeat
    # (it fences itself then), and a posted write fails after the write timeout: their sum must
    # be shorter than the decode workers' grace (common/kv_timing.py). None: the defaults
    # (5 s and 4 s, less under a shorter grace: half and 0.4 of it).
    kv_self_fence_s: float | None = None
    kv_write_timeout_s: float | None = None
    # A prefill worker's KV: layer by layer, whole per step, or "auto" (NixlConnectorConfig)
    kv_layerwise: str = "auto"
    # An engine step running longer turns readiness off until it ends (worker/watchdog.py);
    # None: no watchdog.
    engine_watchdog_s: float | None = ENGINE_WATCHDOG_S
    metrics_port: int | None = None  # Prometheus /metrics over HTTP when set (0 = any free)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry spans to this collector when set
    # The KV block events in vLLM's format on this ZMQ endpoint when set, for external routers
    # (worker/kv_events_zmq.py): "tcp://*:5557" binds, "tcp://HOST:PORT" connects.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""  # every message's topic (llm-d: "kv@<pod>@<model>")
    kv_events_replay_endpoint: str | None = None  # a ROUTER that replays missed batches
    kv_events_encoding: str = "map"  # vLLM's events since vllm#42892; "array": those before

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {self.role!r}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.heartbeat_interval_s <= 0 or self.lease_ttl_s <= 0:
            raise ValueError("heartbeat_interval_s and lease_ttl_s must be positive")
        if self.kv_sender_grace_s is not None and self.kv_sender_grace_s < 0:
            raise ValueError("kv_sender_grace_s must be >= 0")
        _, fence, write = self.kv_timing()
        if fence <= self.heartbeat_interval_s:
            raise ValueError(f"--kv-self-fence ({fence:g} s) must be longer than "
                             f"--heartbeat-interval ({self.heartbeat_interval_s:g} s): a prefill "
                             f"worker would fence itself between two healthy beats")
        if self.engine_watchdog_s is not None and not self.engine_watchdog_s > 0:
            raise ValueError(f"--engine-watchdog must be positive (0: off), got "
                             f"{self.engine_watchdog_s}")
        if not write > 0:
            raise ValueError(f"--kv-write-timeout must be positive, got {write}")
        if self.kv_layerwise not in KV_LAYERWISE:
            raise ValueError(f"kv_layerwise must be one of {KV_LAYERWISE}, got "
                             f"{self.kv_layerwise!r}")
        if self.kv_events_encoding not in KV_EVENTS_ENCODINGS:
            raise ValueError(f"--kv-events-encoding must be one of {KV_EVENTS_ENCODINGS}, got "
                             f"{self.kv_events_encoding!r}")
        if not self.kv_events_endpoint and (self.kv_events_replay_endpoint
                                            or self.kv_events_topic):
            raise ValueError("--kv-events-topic and --kv-events-replay-endpoint need "
                             "--kv-events-endpoint (the event stream is off without it)")

    def kv_timing(self) -> tuple[float, float, float]:
        """(sender grace, self-fence horizon, write timeout), defaults filled in and checked
        against each other (ValueError naming the flags)."""
        grace, fence, write = kv_timing_defaults(self.kv_sender_grace_s)
        fence = fence if self.kv_self_fence_s is None else self.kv_self_fence_s
        write = write if self.kv_write_timeout_s is None else self.kv_write_timeout_s
        check_kv_timing(grace, write, fence)
        return grace, fence, write

    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    def advertised(self, port: int) -> str:
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
