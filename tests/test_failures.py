"""Typed failures between processes (common/failures.py): a worker's abort names a FailureKind
and whether nothing was written; the router reads it back from the trailers of a real gRPC
call on loopback, and through a Session's CallStatus, never from the message text."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrelay.common.convert import metadata_from_proto, metadata_to_proto
from kvrelay.common.failures import (
    NO_FAILURE,
    Failure,
    FailureKind,
    failure_md,
    failure_of,
    parse,
)
from kvrelay.router.calls import dest_failed, draining, nothing_written

METHOD = "/kvrelay.test.Fail/Call"


async def _call_failing_with(code: grpc.StatusCode, trailers: tuple[tuple[str, str], ...]) \
        -> grpc.aio.AioRpcError:
    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(code, "a message no one decides on", trailers)
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "kvrelay.test.Fail", {"Call": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(METHOD)(b"", timeout=10)
        return e.value
    finally:
        await server.stop(None)


@pytest.mark.parametrize("kind,written", [
    (FailureKind.FAILURE_DRAINING, True),
    (FailureKind.FAILURE_KV_DESTINATION, False),
    (FailureKind.FAILURE_OVERLOADED, True),
    (FailureKind.FAILURE_ENGINE, False),
])
def test_a_failure_survives_a_grpc_round_trip(kind: int, written: bool) -> None:
    e = asyncio.run(_call_failing_with(grpc.StatusCode.UNAVAILABLE,
                                       failure_md(kind, nothing_written=not written)))
    assert failure_of(e) == Failure(kind, not written)
    assert nothing_written(e) is (not written)
    assert dest_failed(e) is (kind == FailureKind.FAILURE_KV_DESTINATION)
    assert draining(e) is (kind == FailureKind.FAILURE_DRAINING)


def test_no_trailer_is_no_failure_whatever_the_message_says() -> None:
    e = asyncio.run(_call_failing_with(grpc.StatusCode.UNAVAILABLE, ()))
    assert failure_of(e) == NO_FAILURE
    assert not nothing_written(e) and not dest_failed(e) and not draining(e)


def test_a_session_call_status_carries_the_failure() -> None:
    md = failure_md(FailureKind.FAILURE_DRAINING, nothing_written=True)

    class Status:
        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return metadata_from_proto(metadata_to_proto(md))

    assert failure_of(Status()) == (FailureKind.FAILURE_DRAINING, True)


def test_an_unknown_kind_from_a_newer_peer_keeps_nothing_written() -> None:
    assert parse("FAILURE_FROM_THE_FUTURE,nothing-written") == \
        (FailureKind.FAILURE_UNSPECIFIED, True)
    assert parse("FAILURE_ENGINE") == (FailureKind.FAILURE_ENGINE, False)
    assert Failure(FailureKind.FAILURE_ENGINE, False).name == "FAILURE_ENGINE"


def test_no_worker_decides_on_message_text() -> None:
    """What the issue found: failures classified by a message prefix. None is left."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for folder in ("prefill_worker", "decode_worker", "worker", "router"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            assert ".startswith(KV_TRANSFER" not in text and "e.details().startswith" not in text \
                and '" in e.details()' not in text, path
