"""Logging set-up shared by every kvrelay process: request ids on every line, text or JSON.

``KVRELAY_LOG_LEVEL`` and ``KVRELAY_LOG_FORMAT`` give the defaults; ``KVRELAY_DEBUG_LOGGERS``
(comma-separated logger names) opens a few loggers at DEBUG, e.g. ``kvrelay.common.timeline``, where
components mark a request's steps with ``time.monotonic()`` stamps (one clock for every process
on a host), which ``bench/transfer/pd_latency.py`` lines up across processes.

A request id set with ``request_context`` (a context variable, so it follows asyncio tasks)
appears in each record as ``request_id``; ``component`` names the process (router, worker id).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvrelay_request_id",
                                                                 default="-")
_COMPONENT = "kvrelay"


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    previous = REQUEST_ID.get()
    REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        # Not ``reset(token)``: an async generator may be closed from another task's context
        # (a client cancelling a stream), where the token is foreign and reset raises.
        REQUEST_ID.set(previous)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        record.component = _COMPONENT
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "component": getattr(record, "component", _COMPONENT),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(component)s %(name)s [%(request_id)s] %(message)s"


def setup_logging(component: str, level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger once per process (idempotent)."""
    global _COMPONENT
    _COMPONENT = component
    level = (level or os.environ.get("KVRELAY_LOG_LEVEL", "INFO")).upper()
    fmt = fmt or os.environ.get("KVRELAY_LOG_FORMAT", "text")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_kvrelay", False):
            root.removeHandler(h)
    handler._kvrelay = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Loggers to open at DEBUG whatever the level (e.g. ``kvrelay.common.timeline`` for benchmarks).
    for name in filter(None, os.environ.get("KVRELAY_DEBUG_LOGGERS", "").split(",")):
        logging.getLogger(name.strip()).setLevel(logging.DEBUG)
