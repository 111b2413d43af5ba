"""OpenTelemetry spans across the router and the workers, exported over OTLP when asked.

Off unless a process calls ``setup(service, endpoint)`` with an endpoint (the
``--otlp-traces-endpoint`` option); until then every helper here returns at its first check, so
a request pays one attribute test per call site. opentelemetry (``pip install 'kvrelay[otel]'``)
is imported only by ``setup``: without it tracing stays off, with a warning.

A request's trace crosses processes in the W3C ``traceparent`` gRPC metadata entry (router to
prefill and decode workers) and enters from the client's HTTP ``traceparent`` header or its gRPC
metadata. Spans are passed explicitly (``parent=``), not through a context variable: the router
produces tokens in async generators, which suspend across tasks.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
_TRACEPARENT_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def setup(service: str, endpoint: str | None) -> bool:
    """Export this process's spans to the OTLP/gRPC collector at ``endpoint`` (``host:port`` or
    ``http://host:port``; plaintext unless ``https://``). Returns whether tracing is on."""
    global _tracer, _provider
    if not endpoint:
        return False
    if _tracer is not None:  # one provider per process (a test may run router and worker here)
        return True
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        logger.warning("--otlp-traces-endpoint is set but OpenTelemetry is not installed "
                       "(pip install 'kvrelay[otel]'): tracing stays off (%s)", e)
        return False
    insecure = not endpoint.startswith("https://")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, insecure=insecure), schedule_delay_millis=200))
    _provider = provider
    _tracer = provider.get_tracer("kvrelay")
    logger.info("OpenTelemetry tracing on: service %s, OTLP %s", service, endpoint)
    return True


def shutdown() -> None:
    """Flush and stop the exporter (spans still queued are sent, bounded by its timeout)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.force_flush(5000)
        provider.shutdown()


def _ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` instant as the wall-clock nanoseconds spans carry."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def start(name: str, parent: Any = None, *, start_s: float | None = None,
          **attributes: Any) -> Any:
    """A started span (None while tracing is off), child of ``parent`` (a span, a remote
    parent from ``from_traceparent``, or None: a new trace); ``start_s`` is a monotonic time."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.set_span_in_context(parent) if parent is not None else None
    span = _tracer.start_span(name, context=ctx,
                              start_time=None if start_s is None else _ns(start_s))
    for k, v in attributes.items():
        if v is not None:
            span.set_attribute(k, v)
    return span


def end(span: Any, *, end_s: float | None = None, error: BaseException | str | None = None
        ) -> None:
    """End ``span`` (a no-op on None), marked failed when ``error`` is given."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    span.end(end_time=None if end_s is None else _ns(end_s))


def record(name: str, parent: Any, start_s: float, end_s: float, **attributes: Any) -> None:
    """A finished span measured already (monotonic start and end times)."""
    if _tracer is not None and parent is not None:
        end(start(name, parent, start_s=start_s, **attributes), end_s=end_s)


@contextmanager
def span(name: str, parent: Any = None, **attributes: Any) -> Iterator[Any]:
    """``start``/``end`` around a block; an exception out of it marks the span failed."""
    s = start(name, parent, **attributes)
    if s is None:
        yield None
        return
    try:
        yield s
    except BaseException as e:
        end(s, error=e)
        raise
    end(s)


def event(span: Any, name: str, **attributes: Any) -> None:
    if span is not None:
        span.add_event(name, {k: v for k, v in attributes.items() if v is not None})


# -- propagation (W3C trace context) ------------------------------------------------------------
def traceparent(span: Any) -> str | None:
    if span is None:
        return None
    c = span.get_span_context()
    if not c.is_valid:
        return None
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def from_traceparent(value: str | bytes | None) -> Any:
    """The remote parent a ``traceparent`` value names (None while tracing is off, or when the
    value is missing or malformed: the span then starts a trace of its own)."""
    if _tracer is None or not value:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    m = _TRACEPARENT_RE.match(value.strip().lower())
    if m is None:
        return None
    trace_id, span_id = int(m.group(1), 16), int(m.group(2), 16)
    if trace_id == 0 or span_id == 0:
        return None
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    return NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=True,
                                        trace_flags=TraceFlags(int(m.group(3), 16))))


def from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Any:
    """The remote parent in gRPC invocation metadata (None when tracing is off)."""
    if _tracer is None or not metadata:
        return None
    for k, v in metadata:
        if k == TRACEPARENT:
            return from_traceparent(v)
    return None


def with_parent(metadata: tuple[tuple[str, str], ...], span: Any
                ) -> tuple[tuple[str, str], ...]:
    """``metadata`` plus the ``traceparent`` entry naming ``span`` (unchanged when None)."""
    if span is None:
        return metadata
    tp = traceparent(span)
    return metadata if tp is None else (*metadata, (TRACEPARENT, tp))
