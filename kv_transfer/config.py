"""``NixlConnectorConfig``: the knobs of the KV connector, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.common.kv_timing import KV_SENDER_GRACE_S, KV_WRITE_TIMEOUT_S, check_kv_timing

LAYERWISE = ("auto", "on", "off")


@dataclass(frozen=True)
class NixlConnectorConfig:
    agent_name: str  # unique per worker process group; peers address us by it
    model_id: str  # layout.model_identity(model_dir): refuses peers serving other weights
    # A write not done by then fails (retriable). With ``self_fence_s`` it bounds how long a
    # write can stay in flight after the sender stopped posting: their sum must stay under the
    # receivers' ``sender_gone_grace_s`` (``self_fence``).
    write_timeout_s: float = KV_WRITE_TIMEOUT_S
    max_poll_interval_s: float = 2e-3  # longest wait between completion polls while in flight
    # A receiving request aborted before its KV arrived keeps its blocks until its sender is
    # known to be done (``recv_tracker.Quarantine``): the sender may have writes in flight (a cancel
    # reaches it asynchronously), and they must not land in blocks handed to another request.
    # A sender that no router lists any more counts as done after this grace (its writes time
    # out by then) ...
    sender_gone_grace_s: float = KV_SENDER_GRACE_S
    # ... and a hold that nothing ends is released after this backstop, with a warning.
    quarantine_backstop_s: float = 120.0
    # Stream a step's KV layer by layer while later layers compute ("on"), or post it whole
    # when the step's forward ends ("off"). "auto": layer by layer where the copy can overlap
    # the compute: on a GPU (its copy engines), or on a CPU where this process may run on a
    # core its compute threads leave free. On a CPU the UCX copy runs in the posting thread:
    # with no free core a per-layer post only adds its wake-ups and overhead to the step.
    layerwise: str = "auto"
    # How long a receiving request waits for its KV (None: the engine's default); carried by
    # each expectation (``NixlConnector.expectation``).
    kv_timeout_s: float | None = None
    # A sender posts writes only this long after a router last vouched for it (an answered
    # heartbeat); None: never fenced (no routers). See ``self_fence.SelfFence``.
    self_fence_s: float | None = None

    def __post_init__(self) -> None:
        if not self.agent_name:
            raise ValueError("NixlConnectorConfig.agent_name must be non-empty")
        if not self.model_id:
            raise ValueError("NixlConnectorConfig.model_id must be non-empty")
        if not self.write_timeout_s > 0:
            raise ValueError(f"write_timeout_s must be positive, got {self.write_timeout_s}")
        if self.sender_gone_grace_s < 0 or not self.quarantine_backstop_s > 0:
            raise ValueError(f"sender_gone_grace_s must be >= 0 and quarantine_backstop_s > 0, "
                             f"got {self.sender_gone_grace_s}, {self.quarantine_backstop_s}")
        check_kv_timing(self.sender_gone_grace_s, self.write_timeout_s, self.self_fence_s)
        if self.layerwise not in LAYERWISE:
            raise ValueError(f"layerwise must be one of {LAYERWISE}, got {self.layerwise!r}")
        if not 0 < self.max_poll_interval_s <= 0.1:
            raise ValueError(f"max_poll_interval_s must be in (0, 0.1], got "
                             f"{self.max_poll_interval_s}")
