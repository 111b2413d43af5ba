"""The router's end of ``DecodeWorker.Session``: many streaming calls over one gRPC stream
(the worker's end: ``decode_worker/sessions.py``).

A decode step produces one token for each of its sequences. Streamed as one RPC per request,
that is one gRPC message per token, and each costs the worker and the router ~60-80 µs of CPU
apiece (serialization, the HTTP/2 frame, a completion-queue wake-up), about what a 7M model's
decode step computes per token on two cores. Over a Session, the calls' messages produced while
the worker's stream was busy go out together: one message per step, whatever the batch.

Each call keeps the semantics of its own RPC, so the code on either side does not change:

- the worker runs its ordinary handlers (``Decode``, ``GenerateLocal``) with a context that
  carries the session's invocation metadata and the call's, and turns ``context.abort`` (or an
  error, or the call's deadline) into the call's status with its trailers;
- the router's ``SessionCall`` reads as a ``grpc.aio.UnaryStreamCall`` does: messages, then
  ``grpc.aio.EOF`` or an ``AioRpcError`` with the call's code, details and trailers; cancelling
  it cancels the handler; a call's deadline holds on both ends. When the session itself breaks
  (the worker died), every call on it fails as its own RPC would have; when the channel is
  closed under it (the registry dropped the worker), reads raise ``CancelledError`` as an RPC's
  would. The next call opens a new session.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvrelay.common.convert import metadata_from_proto, metadata_to_proto
from kvrelay.proto import worker_pb2 as wpb

Metadata = tuple[tuple[str, str], ...]

# Invocation metadata that belongs to one call, not to the session it opens.
CALL_METADATA_KEYS = frozenset({"traceparent", "tracestate"})
_CODES = {c.value[0]: c for c in grpc.StatusCode}


# A call's error that reads raise as CancelledError, as an RPC's do: the call was cancelled,
# or the channel was closed under its session.
_CANCELLED = object()


def _copy(e: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(e.code(), e.initial_metadata(), e.trailing_metadata(),
                                e.details(), e.debug_error_string())


def _error(code: grpc.StatusCode, details: str, trailers: Metadata = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


class SessionCall:
    """One call over a session, read as a ``grpc.aio.UnaryStreamCall``: ``read()`` gives its
    messages, then ``grpc.aio.EOF`` (status OK) or raises its error."""

    def __init__(self, link: _Link, call: int, timeout: float | None):
        self._link = link
        self._call = call
        self._messages: collections.deque[Any] = collections.deque()
        self._error: Any = None
        self._done = False
        self._waiter: asyncio.Future[None] | None = None
        self._timer = (None if timeout is None else
                       asyncio.get_running_loop().call_later(max(timeout, 0.0), self._expire))

    async def read(self) -> Any:
        while not self._messages:
            if self._error is not None:
                err = self._error
                if err is _CANCELLED:
                    raise asyncio.CancelledError
                raise _copy(err) if isinstance(err, grpc.aio.AioRpcError) else err
            if self._done:
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._messages.popleft()

    def __aiter__(self) -> SessionCall:
        return self

    async def __anext__(self) -> Any:
        msg = await self.read()
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        return msg

    def cancel(self) -> bool:
        """Give the call up (its handler on the worker is cancelled); False once it ended."""
        if self._done:
            return False
        self._finish(_CANCELLED)
        self._link.send(wpb.SessionOp(call=self._call, cancel=True))
        return True

    def done(self) -> bool:
        return self._done

    def _expire(self) -> None:
        self._timer = None
        if not self._done:
            self._finish(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._link.send(wpb.SessionOp(call=self._call, cancel=True))

    def _deliver(self, event: wpb.SessionEvent) -> None:
        if self._done:
            return
        if event.WhichOneof("event") == "message":
            self._messages.append(event.message)
            self._wake()
            return
        st = event.status
        code = _CODES.get(st.code, grpc.StatusCode.UNKNOWN)
        self._finish(None if code == grpc.StatusCode.OK else
                     _error(code, st.details, metadata_from_proto(st.trailing_metadata)))

    def _finish(self, error: Any) -> None:
        self._done = True
        self._error = error
        self._link.calls.pop(self._call, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Link:
    """One open Session: its RPC, its calls, the ops not sent yet."""

    def __init__(self) -> None:
        self.calls: dict[int, SessionCall] = {}
        self.ops: list[wpb.SessionOp] = []
        self.wake = asyncio.Event()
        self.open = True
        self.next_call = 1
        self.rpc: Any = None
        self.reader: asyncio.Task[None] | None = None
        self.stopping = False  # we cancel the reader ourselves

    def send(self, op: wpb.SessionOp) -> None:
        if self.open:
            self.ops.append(op)
            self.wake.set()

    async def requests(self) -> AsyncIterator[wpb.SessionRequest]:
        while self.open:
            await self.wake.wait()
            self.wake.clear()
            if self.ops:
                ops, self.ops = self.ops, []
                yield wpb.SessionRequest(ops=ops)

    def fail(self, error: Any) -> None:
        self.open = False
        self.wake.set()
        for c in list(self.calls.values()):
            c._finish(error)


class SessionClient:
    """The router's end for one worker: ``Decode`` and ``GenerateLocal`` as the stub's, all of
    them over one Session (opened on the first call, and again after it broke)."""

    def __init__(self, stub: Any):
        self._stub = stub
        self._link: _Link | None = None

    def Decode(self, request: wpb.DecodeRequest, metadata: Metadata = (),
               timeout: float | None = None) -> SessionCall:
        return self._start(wpb.SessionOp(decode=request), metadata, timeout)

    def GenerateLocal(self, request: wpb.LocalGenerateRequest,
                      metadata: Metadata = (), timeout: float | None = None) -> SessionCall:
        return self._start(wpb.SessionOp(generate_local=request), metadata, timeout)

    def _start(self, op: wpb.SessionOp, metadata: Metadata, timeout: float | None
               ) -> SessionCall:
        link = self._link if self._link is not None and self._link.open else self._open(metadata)
        op.call = link.next_call
        link.next_call += 1
        if timeout is not None:
            op.timeout_ms = max(1, int(timeout * 1000))
        op.metadata.extend(metadata_to_proto(kv for kv in metadata if kv[0] in CALL_METADATA_KEYS))
        call = SessionCall(link, op.call, timeout)
        link.calls[op.call] = call
        link.send(op)
        return call

    def _open(self, metadata: Metadata) -> _Link:
        link = _Link()
        # Raises grpc.aio.UsageError on a closed channel, as the stub's own calls do.
        link.rpc = self._stub.Session(
            link.requests(), metadata=tuple(kv for kv in metadata
                                            if kv[0] not in CALL_METADATA_KEYS))
        link.reader = asyncio.get_running_loop().create_task(self._read(link))
        self._link = link
        return link

    async def _read(self, link: _Link) -> None:
        error: Any = _error(grpc.StatusCode.UNAVAILABLE, "the worker ended the session")
        try:
            async for resp in link.rpc:
                for event in resp.events:
                    call = link.calls.get(event.call)
                    if call is not None:
                        call._deliver(event)
        except asyncio.CancelledError:
            error = _CANCELLED  # closed by us, or the channel was closed under the session
            if link.stopping:
                raise
        except grpc.aio.AioRpcError as e:
            error = e
        finally:
            if self._link is link:
                self._link = None
            link.fail(error)

    async def close(self) -> None:
        link, self._link = self._link, None
        if link is None:
            return
        link.stopping = True
        link.rpc.cancel()
        if link.reader is not None:
            link.reader.cancel()
            await asyncio.gather(link.reader, return_exceptions=True)

    @property
    def open_calls(self) -> int:
        return 0 if self._link is None else len(self._link.calls)

    @property
    def session_open(self) -> bool:
        return self._link is not None and self._link.open
