"""Trust between a cluster's own processes: ``kvrelay serve`` gives its actors a cluster token
when none is given, a router whose control port is reachable beyond loopback with no token says
so loudly, and a live worker's id cannot be moved to another address without the token."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.registry import WorkerIdTaken, WorkerRegistry
from kvrelay.router.server import RouterSettings, warn_if_control_exposed


def _beat(worker_id: str, address: str, incarnation: str = "i1") -> wpb.HeartbeatRequest:
    return wpb.HeartbeatRequest(
        worker=wpb.WorkerInfo(worker_id=worker_id, role=wpb.ROLE_DECODE, address=address,
                              incarnation=incarnation, block_size=16, max_model_len=4096),
        load=wpb.WorkerLoad(num_blocks=64, free_blocks=64))


def _addresses_after(authenticated: bool, *beats: wpb.HeartbeatRequest) -> list[object]:
    """What each beat got (None or the exception) and the address the registry holds."""
    async def run() -> list[object]:
        reg = WorkerRegistry(authenticated=authenticated)
        got: list[object] = []
        for b in beats:
            try:
                reg.heartbeat(b)
                got.append(None)
            except ValueError as e:
                got.append(type(e))
        got.append(reg.workers["w"].identity.address)
        await reg.stop()
        return got
    return asyncio.run(run())


def test_a_live_worker_id_stays_at_its_address_without_the_token() -> None:
    got = _addresses_after(False, _beat("w", "10.0.0.1:7000"), _beat("w", "10.6.6.6:7000", "x"))
    assert got == [None, WorkerIdTaken, "10.0.0.1:7000"]
    # the real worker restarting in place (same address, new incarnation) is still welcome
    got = _addresses_after(False, _beat("w", "10.0.0.1:7000"), _beat("w", "10.0.0.1:7000", "i2"))
    assert got == [None, None, "10.0.0.1:7000"]


def test_a_token_holder_may_move_a_worker_id() -> None:
    got = _addresses_after(True, _beat("w", "10.0.0.1:7000"), _beat("w", "10.0.0.2:7000", "i2"))
    assert got == [None, None, "10.0.0.2:7000"]


@pytest.mark.parametrize(("host", "token", "warned"), [
    ("0.0.0.0", None, True), ("10.1.2.3", None, True), ("router.svc", None, True),
    ("0.0.0.0", "s3cret", False), ("127.0.0.1", None, False), ("::1", None, False),
    ("localhost", None, False),
])
def test_router_warns_when_its_control_port_is_exposed_without_a_token(
        caplog, host: str, token: str | None, warned: bool) -> None:
    st = RouterSettings(model="m", control_host=host, cluster_token=token)
    with caplog.at_level(logging.WARNING, logger="kvrelay.router.server"):
        assert warn_if_control_exposed(st) is warned
    assert any("WITHOUT a cluster token" in r.getMessage() for r in caplog.records) is warned


def test_serve_hands_a_generated_token_to_router_and_workers(demo_model_dir,
                                                              monkeypatch) -> None:
    from kvrelay.deploy.ray_cli import prepare_ray_env

    monkeypatch.delenv("KVRELAY_CLUSTER_TOKEN", raising=False)
    prepare_ray_env(None)  # as cmd_serve does before build_spec imports ray
    from kvrelay.cli import build_parser
    from kvrelay.deploy.ray_cli import build_spec

    def spec(*extra: str) -> Any:
        args = build_parser().parse_args(["serve", "--model", demo_model_dir, *extra])
        return build_spec(args, loopback=False)

    a, b = spec(), spec()
    assert a.router.cluster_token and len(a.router.cluster_token) >= 32
    assert a.worker.cluster_token == a.router.cluster_token
    assert b.router.cluster_token != a.router.cluster_token  # fresh per launch
    given = spec("--cluster-token", "the-operators-own")
    assert given.router.cluster_token == given.worker.cluster_token == "the-operators-own"
    # the replicas the controller starts take their settings from spec.worker
    assert warn_if_control_exposed(a.router) is False
