"""Scripted workers for the router's lifecycle tests: each serves the worker gRPC services on a
loopback port of this process and joins the router by heartbeat as a real worker does, but
answers from memory and a script: no model, no KV, no NIXL.

A token follows from the one before (``follows``): a stream resumed anywhere (re-prefilling
prompt + output so far on another pair, as the router does after a failure) continues exactly
as the first pass would have, as greedy decoding of a real model does, so a test compares any
request's output with ``expected``.

A script says what to do to the next calls of an RPC (``fail``): abort with a status and
trailers (a refusal before any KV was written, a failed KV destination, draining), or, for
Decode, stream some tokens first and then break (a worker lost mid-stream). Every lease a
decode worker grants is recorded with how it ended, so a test can check that none is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvrelay.common.rpc import add_health
from kvrelay.decode_worker.sessions import SessionServer
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

VOCAB = 4096
BLOCK_SIZE = 16
NUM_BLOCKS = 1024
ROLES = {"prefill": wpb.ROLE_PREFILL, "decode": wpb.ROLE_DECODE}


def follows(token: int) -> int:
    return (token * 31 + 7) % VOCAB


def expected(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens every scripted worker agrees come after ``prompt``."""
    out, t = [], prompt[-1]
    for _ in range(n):
        t = follows(t)
        out.append(t)
    return out


@dataclass
class Failure:
    code: grpc.StatusCode
    trailers: tuple[tuple[str, str], ...] = ()
    after_tokens: int = 0  # Decode: tokens streamed before the stream breaks


@dataclass
class Lease:
    request_id: str
    blocks: int
    senders: list[str]  # the prefill worker the KV is promised to, and each rebind
    ended: str = ""  # "released", "settled" (released, no write pending) or "decoded"


@dataclass
class FakeWorker:
    role: str
    worker_id: str
    model_identity: str
    free_blocks: int = NUM_BLOCKS
    draining: bool = False
    silent: bool = False  # its beats stop (a starved or stopped process)
    token_gap_s: float = 0.001  # between streamed tokens
    # RPC name -> failures for its next calls, in order (workers may share one: the next call
    # to any of them takes the next failure)
    script: dict[str, list[Failure]] = field(default_factory=dict)
    # RPC name -> awaited with the request before the next call is answered (once)
    before: dict[str, Callable[[Any], Awaitable[None]]] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    leases: dict[str, Lease] = field(default_factory=dict)  # lease id -> lease
    address: str = ""
    incarnation: str = field(default_factory=lambda: secrets.token_hex(4))
    # medium ("host", "disk") -> the block hashes that tier below its pool holds, reported in
    # full each beat (the pool itself holds none)
    tier_hashes: dict[str, list[int]] = field(default_factory=dict)

    def fail(self, rpc: str, *failures: Failure) -> None:
        self.script.setdefault(rpc, []).extend(failures)

    async def leave(self) -> None:
        """Send the last beat a stopping worker sends, then fall silent (it still serves)."""
        self.silent = True
        req = self._beat()
        req.leaving = True
        await worker_pb2_grpc.RegistryStub(self._channel).Heartbeat(req, timeout=1.0)

    def open_leases(self) -> list[Lease]:
        return [lease for lease in self.leases.values() if not lease.ended]

    # -- process ---------------------------------------------------------------------------
    async def start(self, router_control: str, interval_s: float) -> None:
        self._server = grpc.aio.server()
        servicer = _Servicer(self)
        worker_pb2_grpc.add_WorkerControlServicer_to_server(servicer, self._server)
        if self.role == "decode":
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, self._server)
        else:
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, self._server)
        add_health(self._server, [])
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self._server.start()
        self._channel = grpc.aio.insecure_channel(router_control)
        registry = worker_pb2_grpc.RegistryStub(self._channel)
        await registry.Heartbeat(self._beat())
        self._beats = asyncio.get_running_loop().create_task(self._beat_loop(registry,
                                                                             interval_s))

    async def stop(self) -> None:
        self._beats.cancel()
        await asyncio.gather(self._beats, return_exceptions=True)
        await self._server.stop(grace=None)
        await self._channel.close()

    def _beat(self) -> wpb.HeartbeatRequest:
        return wpb.HeartbeatRequest(
            worker=wpb.WorkerInfo(worker_id=self.worker_id, role=ROLES[self.role],
                                  address=self.address, incarnation=self.incarnation,
                                  model_identity=self.model_identity, block_size=BLOCK_SIZE,
                                  max_model_len=4096),
            load=wpb.WorkerLoad(num_blocks=NUM_BLOCKS, free_blocks=self.free_blocks,
                                draining=self.draining,
                                tiers=[wpb.TierLoad(medium=m, capacity_blocks=4 * NUM_BLOCKS)
                                       for m in self.tier_hashes]),
            tiers=[wpb.TierBlocks(medium="device", full=True)]
            + [wpb.TierBlocks(medium=m, added=hs, full=True)
               for m, hs in self.tier_hashes.items()])

    async def _beat_loop(self, registry: worker_pb2_grpc.RegistryStub, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            if not self.silent:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await registry.Heartbeat(self._beat(), timeout=1.0)

    async def scripted(self, rpc: str, context: grpc.aio.ServicerContext,
                       tokens_so_far: int = 0, request: Any = None) -> None:
        """Count the call (on its first token, for Decode), run its ``before`` hook, and abort
        it when the script says so."""
        if tokens_so_far == 0:
            self.calls[rpc] += 1
            hook = self.before.pop(rpc, None)
            if hook is not None:
                await hook(request)
        queue = self.script.get(rpc)
        if queue and queue[0].after_tokens <= tokens_so_far:
            f = queue.pop(0)
            context.set_trailing_metadata(f.trailers)
            await context.abort(f.code, f"scripted {rpc} failure on {self.worker_id}")


class _Servicer(worker_pb2_grpc.WorkerControlServicer,
                worker_pb2_grpc.DecodeWorkerServicer,
                worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, w: FakeWorker) -> None:
        self.w = w
        self.sessions = SessionServer({"decode": self.Decode})

    async def Session(self, request_iterator: AsyncIterator[wpb.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.SessionResponse]:
        async for resp in self.sessions.serve(request_iterator, context):
            yield resp

    # -- decode worker -----------------------------------------------------------------------
    async def Reserve(self, request: wpb.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> wpb.ReserveResponse:
        await self.w.scripted("Reserve", context, request=request)
        n = -(-(len(request.prompt_token_ids) + 1) // BLOCK_SIZE)
        lease_id = secrets.token_hex(6)
        self.w.leases[lease_id] = Lease(request.request_id, n, [request.sender_agent])
        return wpb.ReserveResponse(lease_id=lease_id, block_ids=range(n),
                                   agent_name=self.w.worker_id, incarnation=self.w.incarnation,
                                   ttl_ms=request.ttl_ms)

    def _lease(self, request_id: str, lease_id: str) -> Lease | None:
        if lease_id:
            return self.w.leases.get(lease_id)
        return next((x for x in self.w.leases.values()
                     if x.request_id == request_id and not x.ended), None)

    async def RenewLease(self, request: wpb.LeaseRequest,
                         context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        lease = self._lease(request.request_id, request.lease_id)
        if lease is None or lease.ended:
            return wpb.LeaseResponse(ok=False)
        if request.sender_agent:
            lease.senders.append(request.sender_agent)
        return wpb.LeaseResponse(ok=True)

    async def Release(self, request: wpb.LeaseRequest,
                      context: grpc.aio.ServicerContext) -> wpb.LeaseResponse:
        self.w.calls["Release"] += 1
        lease = self._lease(request.request_id, request.lease_id)
        if lease is None or lease.ended:
            return wpb.LeaseResponse(ok=False)
        lease.ended = "settled" if request.writes_settled else "released"
        return wpb.LeaseResponse(ok=True)

    async def Decode(self, request: wpb.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[wpb.DecodeResponse]:
        lease = self.w.leases.get(request.lease_id)
        if lease is None or lease.ended:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")
        assert lease is not None
        t = request.first_token_id
        for i in range(1, request.sampling.max_tokens):
            await self.w.scripted("Decode", context, tokens_so_far=i - 1)
            t = follows(t)
            last = i == request.sampling.max_tokens - 1
            if last:
                lease.ended = "decoded"
            yield wpb.DecodeResponse(token_ids=[t], finish_reason=pb.FINISH_REASON_LENGTH
                                     if last else pb.FINISH_REASON_UNSPECIFIED)
            await asyncio.sleep(self.w.token_gap_s)

    # -- prefill worker ----------------------------------------------------------------------
    async def Prefill(self, request: wpb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> wpb.PrefillResponse:
        await self.w.scripted("Prefill", context)
        return wpb.PrefillResponse(first_token_id=follows(request.prompt_token_ids[-1]),
                                   worker_id=self.w.worker_id, prefill_ms=1.0)

    # -- every worker ------------------------------------------------------------------------
    async def GetStatus(self, request: wpb.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> wpb.WorkerStatus:
        beat = self.w._beat()
        return wpb.WorkerStatus(info=beat.worker, load=beat.load)


_ids = itertools.count(1)


def fake(role: str, model_identity: str, **kw: object) -> FakeWorker:
    return FakeWorker(role, f"fake-{role}-{next(_ids)}", model_identity, **kw)  # type: ignore[arg-type]
