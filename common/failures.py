"""Typed failures between processes: why a worker refused or failed a call.

A worker that aborts a call names the failure's kind (``FailureKind`` in worker.proto) and
whether nothing was written, in one trailing-metadata entry; the router reads it back with
:func:`failure_of` and decides on it (retry elsewhere, migrate the request, suspect the worker),
never on the status message's text, which is for people.

    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining",
                        failure_md(FailureKind.FAILURE_DRAINING, nothing_written=True))
    ...
    failure_of(rpc_error).kind == FailureKind.FAILURE_DRAINING

The entry is text (``"FAILURE_DRAINING,nothing-written"``) so that a Session's ``CallStatus``
carries it like any other trailer. A kind this process does not know (a newer peer) reads as
``FAILURE_UNSPECIFIED``, with ``nothing_written`` still honoured.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc

from kvrelay.proto import worker_pb2 as wpb

FAILURE_KEY = "x-kvrelay-failure"
NOTHING_WRITTEN = "nothing-written"
FailureKind = wpb.FailureKind


class Failure(NamedTuple):
    kind: int  # a FailureKind value
    nothing_written: bool

    @property
    def name(self) -> str:
        return FailureKind.Name(self.kind)


NO_FAILURE = Failure(FailureKind.FAILURE_UNSPECIFIED, False)


def failure_md(kind: int, *, nothing_written: bool = False) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that names a failure (``kind`` is a FailureKind value)."""
    value = FailureKind.Name(kind) + (f",{NOTHING_WRITTEN}" if nothing_written else "")
    return ((FAILURE_KEY, value),)


def parse(value: str) -> Failure:
    name, _, flags = value.partition(",")
    try:
        kind = FailureKind.Value(name)
    except ValueError:
        kind = FailureKind.FAILURE_UNSPECIFIED
    return Failure(kind, NOTHING_WRITTEN in flags.split(","))


def failure_of(error: Any) -> Failure:
    """The failure a call's trailers name (``NO_FAILURE`` when none): ``error`` is an
    ``AioRpcError`` or anything with ``trailing_metadata()``."""
    try:
        md = tuple(error.trailing_metadata() or ())
    except Exception:  # a locally made error without trailers
        return NO_FAILURE
    for key, value in md:
        if key == FAILURE_KEY:
            return parse(value if isinstance(value, str) else value.decode())
    return NO_FAILURE


class CallRefused(Exception):
    """A worker service's refusal of a call. Services raise it; their servicer turns it into
    the call's status (``code``, ``message``) and typed trailers (``kind``, nothing written)
    through :func:`refusals`, so the service needs no gRPC context and the servicer no logic."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 kind: int = FailureKind.FAILURE_UNSPECIFIED, *,
                 nothing_written: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.kind = kind
        self.nothing_written = nothing_written

    def trailers(self) -> tuple[tuple[str, str], ...]:
        if self.kind == FailureKind.FAILURE_UNSPECIFIED and not self.nothing_written:
            return ()
        return failure_md(self.kind, nothing_written=self.nothing_written)


@contextlib.asynccontextmanager
async def refusals(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Around a servicer's call into its service: a ``CallRefused`` aborts the call."""
    try:
        yield
    except CallRefused as e:
        await context.abort(e.code, e.message, e.trailers())
