"""Router readiness: gRPC health and HTTP /health say SERVING only while a request could be
served (an aggregated worker, or a prefill and a decode worker), whatever else has joined."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import grpc
import httpx
import pytest
from cluster import Cluster, Forked
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.forking import ZygoteChild

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _grpc_health(c: Cluster, service: str = "") -> int:
    with grpc.insecure_channel(c.address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _http_health(c: Cluster) -> int:
    return httpx.get(f"http://127.0.0.1:{c.router.ready['http_port']}/health", timeout=5) \
        .status_code


def _modules(proc) -> str:
    """The shared objects a process has mapped (torch's libraries once it imported torch)."""
    with open(f"/proc/{proc.popen.pid}/maps") as f:
        return f.read()


def _wait(c: Cluster, want: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _grpc_health(c) != want:
        assert time.monotonic() < deadline, f"health never became {want}"
        time.sleep(0.1)


def test_router_is_not_serving_until_it_can_serve(demo_model_dir, tmp_path) -> None:
    with Cluster(demo_model_dir, tmp_path, prefill=0, decode=0,
                 router_args=("--http-port", "0")) as c:
        for service in ("", "kvrelay.v1.Generation"):
            assert _grpc_health(c, service) == NOT_SERVING
        assert _http_health(c) == 503
        # A prefill worker alone serves nothing. (The harness forks workers from its fork
        # server unless their environment differs in what is read at import: this one is
        # exec'd, the decode worker forked; a cluster of both kinds serves alike.)
        prefill = c.add_worker("prefill", env={"MALLOC_ARENA_MAX": "2"})
        assert isinstance(prefill.popen, subprocess.Popen)
        time.sleep(0.5)  # a few of the router's checks
        assert _grpc_health(c) == NOT_SERVING and _http_health(c) == 503
        decode = c.add_worker("decode")
        assert isinstance(decode.popen, Forked) and decode.popen.pid != os.getpid()
        _wait(c, SERVING)
        assert _http_health(c) == 200
        with c.client() as client:  # and healthy means served
            from kvrelay.client import sampling
            assert len(client.generate("ready?", sampling(3, 0.0, ignore_eos=True))
                       .token_ids) == 3
        # Without its decode worker it cannot serve again.
        c.kill(decode)
        assert decode.popen.returncode == -signal.SIGKILL
        _wait(c, NOT_SERVING)
        assert _http_health(c) == 503
        # The router was forked by the harness's torch-free zygote, which reports its exit.
        assert isinstance(c.router.popen, ZygoteChild)
        assert "libtorch" not in _modules(c.router) and "libtorch" in _modules(prefill)
        c.kill(c.router)
        assert c.router.popen.returncode == -signal.SIGKILL
