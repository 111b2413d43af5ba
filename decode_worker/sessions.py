"""The worker's end of ``DecodeWorker.Session``: many Decode and GenerateLocal calls over one
gRPC stream (the router's end, and why: ``router/sessions.py``).

Each call runs the servicer's ordinary handler with a :class:`CallContext` that carries the
session's invocation metadata and the call's, and turns ``context.abort`` (or an error, or the
call's deadline) into the call's status with its trailers. Everything the calls produced while
the stream was busy goes out as one message: a decode step's tokens for all of its requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc

from kvrelay.common.convert import metadata_from_proto, metadata_to_proto
from kvrelay.common.failures import FailureKind, failure_md
from kvrelay.proto import worker_pb2 as wpb

logger = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]
# A call's handler: the servicer method of its RPC (request, context) -> its messages.
Handler = Callable[[Any, Any], AsyncIterator[Any]]


class _Abort(Exception):
    """``context.abort`` of a call: its status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: Metadata):
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers


class CallContext:
    """What a call's handler sees of ``grpc.aio.ServicerContext``: metadata, abort, trailers."""

    def __init__(self, metadata: Metadata, peer: str):
        self._metadata = metadata
        self._peer = peer
        self._trailers: Metadata = ()
        self._done: list[Callable[[CallContext], object]] = []
        self._cancelled = False

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def set_trailing_metadata(self, trailing_metadata: Iterable[tuple[str, str]]) -> None:
        self._trailers = tuple(trailing_metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Iterable[tuple[str, str]] = ()) -> None:
        raise _Abort(code, details, tuple(trailing_metadata) or self._trailers)

    def add_done_callback(self, callback: Callable[[CallContext], object]) -> None:
        self._done.append(callback)

    def cancelled(self) -> bool:
        return self._cancelled

    def _finish(self, cancelled: bool) -> None:
        self._cancelled = cancelled
        for cb in self._done:
            try:
                cb(self)
            except Exception:
                logger.exception("a call's done callback failed")


class _ServerSession:
    """One router's Session: its calls' tasks and the events they produced, not sent yet."""

    def __init__(self, handlers: Mapping[str, Handler], context: grpc.aio.ServicerContext):
        self.handlers = handlers
        self.metadata: Metadata = tuple(context.invocation_metadata() or ())
        self.peer = context.peer()
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.events: list[wpb.SessionEvent] = []
        self.wake = asyncio.Event()
        self.reading = True  # the router may still start calls
        self.closing = False  # the worker is stopping: no new calls; end once idle

    def start(self, op: wpb.SessionOp) -> None:
        kind = op.WhichOneof("op")
        if kind == "cancel":
            # Popped here: a task cancelled before it ran never runs its own cleanup.
            task = self.calls.pop(op.call, None)
            if task is not None:
                task.cancel()
            return
        handler = self.handlers.get(kind or "")
        if handler is None or op.call in self.calls:
            self.end(op.call, grpc.StatusCode.INVALID_ARGUMENT,
                     f"session op {kind!r} for call {op.call} cannot start", ())
            return
        ctx = CallContext(metadata_from_proto(op.metadata) + self.metadata, self.peer)
        timeout = op.timeout_ms / 1000.0 if op.timeout_ms else None
        self.calls[op.call] = asyncio.get_running_loop().create_task(
            self._run(op.call, handler(getattr(op, kind), ctx), ctx, timeout))

    async def _run(self, call: int, messages: AsyncIterator[Any], ctx: CallContext,
                   timeout: float | None) -> None:
        code, details, trailers = grpc.StatusCode.OK, "", ()
        cancelled = False
        try:
            await asyncio.wait_for(self._pump(call, messages), timeout)
            trailers = ctx._trailers
        except _Abort as e:
            code, details, trailers = e.code, e.details, e.trailers
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except asyncio.CancelledError:
            code, details, cancelled = grpc.StatusCode.CANCELLED, "Cancelled", True
        except Exception as e:  # as grpc ends a handler's unexpected error
            logger.exception("session call %d failed", call)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"
        finally:
            self.calls.pop(call, None)
            ctx._finish(cancelled)
            self.end(call, code, details, trailers)

    async def _pump(self, call: int, messages: AsyncIterator[Any]) -> None:
        async for msg in messages:
            self.events.append(wpb.SessionEvent(call=call, message=msg))
            self.wake.set()

    def end(self, call: int, code: grpc.StatusCode, details: str, trailers: Metadata) -> None:
        self.events.append(wpb.SessionEvent(call=call, status=wpb.CallStatus(
            code=code.value[0], details=details, trailing_metadata=metadata_to_proto(trailers))))
        self.wake.set()

    async def read(self, requests: AsyncIterator[wpb.SessionRequest]) -> None:
        try:
            async for req in requests:
                for op in req.ops:
                    if self.closing and op.WhichOneof("op") != "cancel":
                        self.end(op.call, grpc.StatusCode.UNAVAILABLE, "worker is stopping",
                                 failure_md(FailureKind.FAILURE_DRAINING))
                    else:
                        self.start(op)
        finally:
            self.reading = False
            self.wake.set()

    @property
    def over(self) -> bool:
        """Nothing left to send and nothing that could add to it."""
        return not self.events and not self.calls and (not self.reading or self.closing)


class SessionServer:
    """The worker's end: serves Sessions with the servicer's handlers (op name -> handler)."""

    def __init__(self, handlers: Mapping[str, Handler]):
        self.handlers = dict(handlers)
        self._sessions: set[_ServerSession] = set()

    async def serve(self, requests: AsyncIterator[wpb.SessionRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.SessionResponse]:
        s = _ServerSession(self.handlers, context)
        self._sessions.add(s)
        reader = asyncio.get_running_loop().create_task(s.read(requests))
        try:
            while not s.over:
                await s.wake.wait()
                s.wake.clear()
                if s.events:
                    # Every event since the last write: the calls a step's outputs woke ran
                    # before this task (they were ready first), so a step goes out whole.
                    events, s.events = s.events, []
                    yield wpb.SessionResponse(events=events)
        finally:
            self._sessions.discard(s)
            reader.cancel()
            for task in list(s.calls.values()):  # the router left: as if it cancelled each
                task.cancel()

    def close(self) -> None:
        """Stop taking calls; each session ends (status OK) once its calls ended and their
        events went out, so that a stopping server need not wait out its grace period."""
        for s in self._sessions:
            s.closing = True
            s.wake.set()

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)
