"""A request's trace: named events with times since the router received it, and who did what."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class TraceEvent:
    name: str
    t_ms: float
    worker: str = ""
    detail: str = ""


@dataclass
class Trace:
    t0: float = field(default_factory=time.monotonic)
    events: list[TraceEvent] = field(default_factory=list)
    prefill: Any = None  # the PrefillResponse, for its timings
    reserve_ms: float = 0.0  # the last Reserve round trip
    decode_kv_wait_ms: float = 0.0  # the decode worker's wait for the KV, as it reported it
    span: Any = None  # the request's OpenTelemetry span (common.tracing), None when off

    def add(self, name: str, worker: str = "", detail: str = "") -> TraceEvent:
        ev = TraceEvent(name, (time.monotonic() - self.t0) * 1000.0, worker, detail)
        self.events.append(ev)
        return ev

    def add_prefill_end(self, worker: str, resp: Any) -> None:
        """The prefill's answer (a ``PrefillResponse``): its timings in the event, kept."""
        self.add("prefill_end", worker,
                 detail=f"queue={resp.queue_ms:.1f}ms prefill={resp.prefill_ms:.1f}ms "
                        f"transfer={resp.transfer_ms:.1f}ms bytes={resp.kv_bytes}")
        self.prefill = resp

    def first(self, name: str) -> TraceEvent | None:
        return next((e for e in self.events if e.name == name), None)

    def summary(self) -> str:
        return " ".join(f"{e.name}@{e.t_ms:.1f}ms" + (f"[{e.worker}]" if e.worker else "")
                        for e in self.events)
