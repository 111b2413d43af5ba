"""The router's control port against callers without the cluster token: registrations are
bounded per role (RESOURCE_EXHAUSTED past the cap, nothing added), and ListWorkers does not
reveal incarnations (with them a caller could forge a worker's leaving beat). In-process: the
registry behind its real gRPC servicer."""

from __future__ import annotations

import asyncio

import grpc

from kvrelay.common.rpc import bind, make_server
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.grpc_api import RegistryServicer
from kvrelay.router.registry import WorkerRegistry

IDENTITY = "demo-model"


def _beat(worker_id: str, role: int = wpb.ROLE_DECODE) -> wpb.HeartbeatRequest:
    return wpb.HeartbeatRequest(
        worker=wpb.WorkerInfo(worker_id=worker_id, role=role, address="127.0.0.1:9",
                              incarnation=f"inc-{worker_id}", block_size=16, max_model_len=4096,
                              model_identity=IDENTITY),
        load=wpb.WorkerLoad(num_blocks=64, free_blocks=64),
        tiers=[wpb.TierBlocks(medium="device", full=True)])


async def _serve(registry: WorkerRegistry) -> tuple[grpc.aio.Server, str]:
    server = make_server()
    worker_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(registry), server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_registrations_are_capped_per_role() -> None:
    async def scenario() -> None:
        registry = WorkerRegistry(model_identity=IDENTITY, max_workers_per_role=3)
        server, address = await _serve(registry)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = worker_pb2_grpc.RegistryStub(ch)
                for k in range(3):
                    await stub.Heartbeat(_beat(f"d{k}"), timeout=5)
                try:
                    await stub.Heartbeat(_beat("d-extra"), timeout=5)
                    raise AssertionError("a fourth decode worker was registered")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "decode workers" in (e.details() or "")
                assert sorted(registry.workers) == ["d0", "d1", "d2"]
                await stub.Heartbeat(_beat("d1"), timeout=5)  # a registered one still beats
                await stub.Heartbeat(_beat("p0", wpb.ROLE_PREFILL), timeout=5)  # another role
                assert "p0" in registry.workers
        finally:
            await server.stop(None)
            await registry.stop()

    asyncio.run(scenario())


def test_list_workers_hides_incarnations_without_a_cluster_token() -> None:
    async def listed(authenticated: bool) -> list[wpb.WorkerStatus]:
        registry = WorkerRegistry(model_identity=IDENTITY, authenticated=authenticated)
        server, address = await _serve(registry)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = worker_pb2_grpc.RegistryStub(ch)
                await stub.Heartbeat(_beat("d0"), timeout=5)
                return list((await stub.ListWorkers(wpb.ListWorkersRequest(),
                                                    timeout=5)).workers)
        finally:
            await server.stop(None)
            await registry.stop()

    open_port = asyncio.run(listed(False))
    assert [w.info.worker_id for w in open_port] == ["d0"]
    assert open_port[0].info.incarnation == ""
    assert asyncio.run(listed(True))[0].info.incarnation == "inc-d0"  # token holders only
