"""A request's trace: typed steps with times since the router received it, and who did what.

The steps are the router's record of what happened to a request; its metrics count them
(``RouterService``), clients get them by name (``x-kvrelay-trace``, the gRPC trace field), and
the log line of a finished request lists them.
"""

from __future__ import annotations

import enum
import itertools
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.common import tracing

logger = logging.getLogger(__name__)


class Step(enum.Enum):
    RECEIVED = "received"
    LOCAL_START = "local_start"  # the fast lane (or a role=both worker); detail: why
    LOCAL_FAILED = "local_failed"  # the fast lane refused before a token: disaggregated now
    PREFILL_START = "prefill_start"  # detail: why disaggregated, or "retry"
    RESERVED = "reserved"  # KV blocks reserved on a decode worker
    DESTINATION = "destination"  # the Prefill sent ahead learnt its destination
    PREFILL_FAILED = "prefill_failed"
    PREFILL_END = "prefill_end"
    DECODE_START = "decode_start"
    DECODE_FIRST = "decode_first"
    FIRST_TOKEN = "first_token"  # the first text went out
    MIGRATE = "migrate"  # the request resumes on other workers
    FINISHED = "finished"


@dataclass
class TraceEvent:
    step: Step
    t_ms: float
    worker: str = ""
    detail: str = ""

    @property
    def name(self) -> str:
        return self.step.value


@dataclass
class Trace:
    t0: float = field(default_factory=time.monotonic)
    events: list[TraceEvent] = field(default_factory=list)
    prefill: Any = None  # the PrefillResponse, for its timings
    reserve_ms: float = 0.0  # the last Reserve round trip
    decode_kv_wait_ms: float = 0.0  # the decode worker's wait for the KV, as it reported it
    span: Any = None  # the request's OpenTelemetry span (common.tracing), None when off

    def add(self, step: Step, worker: str = "", detail: str = "") -> TraceEvent:
        ev = TraceEvent(step, (time.monotonic() - self.t0) * 1000.0, worker, detail)
        self.events.append(ev)
        return ev

    def add_prefill_end(self, worker: str, resp: Any) -> None:
        """The prefill's answer (a ``PrefillResponse``): its timings in the event, kept."""
        self.add(Step.PREFILL_END, worker,
                 detail=f"queue={resp.queue_ms:.1f}ms prefill={resp.prefill_ms:.1f}ms "
                        f"transfer={resp.transfer_ms:.1f}ms bytes={resp.kv_bytes}")
        self.prefill = resp

    def first(self, step: Step) -> TraceEvent | None:
        return next((e for e in self.events if e.step is step), None)

    def count(self, step: Step) -> int:
        return sum(e.step is step for e in self.events)

    def summary(self) -> str:
        return " ".join(f"{e.name}@{e.t_ms:.1f}ms" + (f"[{e.worker}]" if e.worker else "")
                        for e in self.events)


# -- the client's trace context (W3C traceparent) ------------------------------------------------
# version-traceid-parentid-flags, lowercase hex; a later version may append fields after a '-'.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?",
                          re.DOTALL)
MAX_TRACEPARENT = 512  # characters: version 00 is 55; later versions may add a little


def client_parent(values: Iterable[str | bytes]) -> Any:
    """The remote parent of a request's trace, from the ``traceparent`` values a client sent
    (HTTP headers or gRPC metadata entries): None (a trace of the router's own) while tracing
    is off, or unless there is exactly one value and it is valid as W3C Trace Context reads
    it: lowercase hex, version ``ff`` never, version ``00`` with nothing after its flags, no
    all-zero id. The trace continues under the client's trace and span ids, which W3C has
    callers propagate, and nothing more: the client's flags are not taken, the router records
    the request's spans whatever the client's sampled bit says (its own and the workers', which
    inherit the router's flags), and ``tracestate`` is not read."""
    if not tracing.enabled():
        return None
    got = list(itertools.islice(values, 2))
    if len(got) != 1:  # none, or several: W3C has a receiver ignore duplicates
        return None
    value = got[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not isinstance(value, str) or len(value) > MAX_TRACEPARENT:
        return None
    m = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if m is None:
        return None
    version, trace_id, span_id, _flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) \
            or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return tracing.from_traceparent(f"00-{trace_id}-{span_id}-01")  # sampled: the router's call
