"""``DecodeWorker.Session`` (decode_worker/sessions.py, router/sessions.py): many calls over
one gRPC stream, each read as its own RPC would be: messages in order, then EOF or its status
with details and trailers; cancellation and deadlines reach the handler; a broken session fails
every call on it and the next call opens a new one; a step's messages for all calls go out as
one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from kvrelay.decode_worker.sessions import SessionServer
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.sessions import SessionClient

TOKEN = (("x-kvrelay-cluster-token", "s3cret"),)


class Steps:
    """An engine stand-in: every call waits for the same steps, as a decode batch does."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()
        self.step = 0

    async def advance(self, n: int, every_s: float = 0.002) -> None:
        for _ in range(n):
            await asyncio.sleep(every_s)
            async with self.cond:
                self.step += 1
                self.cond.notify_all()

    async def wait_past(self, step: int) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.step > step)


class Servicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, decode: Callable[[Any, Any], AsyncIterator[wpb.DecodeResponse]]):
        self.sessions = SessionServer({"decode": decode})
        self.writes = 0

    async def Session(self, request_iterator, context):
        async for resp in self.sessions.serve(request_iterator, context):
            self.writes += 1
            yield resp


async def with_worker(decode, body: Callable[..., Awaitable[None]]) -> Servicer:
    server = grpc.aio.server()
    servicer = Servicer(decode)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = SessionClient(worker_pb2_grpc.DecodeWorkerStub(channel))
    try:
        await asyncio.wait_for(body(client, servicer, server, channel), 20.0)
    finally:
        await client.close()
        await channel.close()
        await server.stop(grace=None)
    return servicer


def decode_req(first: int, max_tokens: int) -> wpb.DecodeRequest:
    return wpb.DecodeRequest(request_id=f"r{first}", first_token_id=first,
                             sampling=pb.SamplingParams(max_tokens=max_tokens))


async def read_all(call) -> list[int]:
    out = []
    async for msg in call:
        out.extend(msg.token_ids)
    return out


def test_many_calls_share_one_session_and_a_step_goes_out_as_one_message() -> None:
    steps = Steps()
    seen_md: list[tuple] = []

    async def decode(req, ctx):
        seen_md.append(tuple(ctx.invocation_metadata()))
        for i in range(req.sampling.max_tokens):
            await steps.wait_past(i)
            yield wpb.DecodeResponse(token_ids=[req.first_token_id + i])

    async def body(client, servicer, server, channel) -> None:
        calls = [client.Decode(decode_req(1000 * k, 20),
                               metadata=(*TOKEN, ("traceparent", f"tp-{k}")))
                 for k in range(8)]
        readers = [asyncio.ensure_future(read_all(c)) for c in calls]
        await asyncio.sleep(0.05)  # every call started on the worker
        await steps.advance(20)
        outs = await asyncio.gather(*readers)
        assert outs == [list(range(1000 * k, 1000 * k + 20)) for k in range(8)]
        assert servicer.sessions.open_sessions == 1
        # 8 x 20 messages and 8 statuses in about one write per step
        assert servicer.writes <= 40, servicer.writes

    asyncio.run(with_worker(decode, body))
    # the session's metadata (the cluster token) and each call's own trace parent
    assert sorted(md[0] for md in seen_md) == sorted(("traceparent", f"tp-{k}")
                                                     for k in range(8))
    assert all(("x-kvrelay-cluster-token", "s3cret") in md for md in seen_md)
    assert all(sum(k == "traceparent" for k, _ in md) == 1 for md in seen_md)


def test_a_call_ends_with_its_own_status_details_and_trailers() -> None:
    async def decode(req, ctx):
        yield wpb.DecodeResponse(token_ids=[req.first_token_id])
        if req.first_token_id == 1:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, "no such lease", (("x-why", "gone"),))
        if req.first_token_id == 2:
            ctx.set_trailing_metadata((("x-why", "set first"),))
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        if req.first_token_id == 3:
            raise RuntimeError("boom")

    async def body(client, *_: Any) -> None:
        for first, code, details, trailer in (
                (1, grpc.StatusCode.NOT_FOUND, "no such lease", ("x-why", "gone")),
                (2, grpc.StatusCode.UNAVAILABLE, "draining", ("x-why", "set first")),
                (3, grpc.StatusCode.UNKNOWN, "Unexpected RuntimeError: boom", None)):
            call = client.Decode(decode_req(first, 1))
            assert list((await call.read()).token_ids) == [first]  # messages before status
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == code and e.value.details() == details
            if trailer:
                assert trailer in tuple(e.value.trailing_metadata())
        ok = client.Decode(decode_req(7, 1))
        assert await read_all(ok) == [7]
        assert await ok.read() is grpc.aio.EOF

    asyncio.run(with_worker(decode, body))


def test_cancel_and_deadline_reach_the_handler() -> None:
    ended: dict[int, str] = {}

    async def decode(req, ctx):
        try:
            yield wpb.DecodeResponse(token_ids=[req.first_token_id])
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            ended[req.first_token_id] = "cancelled"
            raise

    async def body(client, *_: Any) -> None:
        call = client.Decode(decode_req(1, 5))
        await call.read()
        assert call.cancel() and not call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        late = client.Decode(decode_req(2, 5), timeout=0.3)
        await late.read()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await late.read()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(200):
            if len(ended) == 2:
                break
            await asyncio.sleep(0.01)
        assert ended == {1: "cancelled", 2: "cancelled"}

    asyncio.run(with_worker(decode, body))


def test_a_worker_closing_its_sessions_finishes_their_calls_first() -> None:
    steps = Steps()

    async def decode(req, ctx):
        for i in range(req.sampling.max_tokens):
            await steps.wait_past(i)
            yield wpb.DecodeResponse(token_ids=[i])

    async def body(client, servicer, server, channel) -> None:
        call = client.Decode(decode_req(0, 6))
        reader = asyncio.ensure_future(read_all(call))
        await asyncio.sleep(0.05)
        servicer.sessions.close()  # a stopping worker: the call in flight still finishes
        await steps.advance(6)
        assert await reader == list(range(6))
        for _ in range(200):  # then the session ends (status OK) by itself
            if servicer.sessions.open_sessions == 0 and not client.session_open:
                break
            await asyncio.sleep(0.01)
        assert servicer.sessions.open_sessions == 0 and not client.session_open
        nxt = client.Decode(decode_req(0, 2))  # a new session
        reader = asyncio.ensure_future(read_all(nxt))
        await asyncio.sleep(0.05)
        await steps.advance(2)
        assert await reader == list(range(2))

    asyncio.run(with_worker(decode, body))


def test_a_dead_worker_fails_every_call_and_a_closed_channel_cancels_reads() -> None:
    async def decode(req, ctx):
        yield wpb.DecodeResponse(token_ids=[req.first_token_id])
        await asyncio.sleep(30)

    async def body(client, servicer, server, channel) -> None:
        calls = [client.Decode(decode_req(k, 5)) for k in range(3)]
        for c in calls:
            await c.read()
        await server.stop(grace=None)  # the worker is gone
        for c in calls:
            with pytest.raises(grpc.aio.AioRpcError):
                await c.read()

    asyncio.run(with_worker(decode, body))

    async def body2(client, servicer, server, channel) -> None:
        call = client.Decode(decode_req(1, 5))
        await call.read()
        await channel.close()  # the registry dropped the worker
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        with pytest.raises(grpc.aio.UsageError):
            client.Decode(decode_req(2, 5))

    asyncio.run(with_worker(decode, body2))
