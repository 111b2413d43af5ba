"""What a deployed process sets up from its command line before it serves: the cluster token
(from a file, as the manifests pass it; loud when a port is exposed without one) and the
locked-memory limit RDMA needs (common/options.py, kvrelay/cli.py)."""

from __future__ import annotations

import argparse
import logging
import resource
from pathlib import Path

import grpc
import pytest

from kvrelay.cli import raise_memlock_limit
from kvrelay.common.options import (
    cluster_token_from_args,
    read_cluster_token,
    warn_if_exposed_without_token,
)
from kvrelay.common.rpc import CLUSTER_TOKEN_KEY
from kvrelay.local_cluster import Cluster
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

TOKEN = "file-token-0123456789abcdef0123456789abcdef"


# -- the cluster token ----------------------------------------------------------------------------
def test_the_token_file_holds_one_token(tmp_path: Path) -> None:
    f = tmp_path / "cluster-token"
    f.write_text(f"  {TOKEN}\n")  # as `kubectl create secret --from-file` may leave it
    assert read_cluster_token(None, str(f)) == TOKEN
    assert read_cluster_token(TOKEN, str(f)) == TOKEN  # the same twice is fine
    assert read_cluster_token("plain", None) == "plain"
    assert read_cluster_token(None, None) is None and read_cluster_token("", "") is None
    for text, why in (("", "empty"), ("\n \n", "empty"), ("one two\n", "whitespace"),
                      ("a\nb\n", "whitespace")):
        f.write_text(text)
        with pytest.raises(SystemExit, match=why):
            read_cluster_token(None, str(f))
    with pytest.raises(SystemExit, match="No such file"):
        read_cluster_token(None, str(tmp_path / "absent"))
    f.write_text(TOKEN)
    with pytest.raises(SystemExit, match="differ"):
        read_cluster_token("another", str(f))


def test_warnings_for_a_token_in_argv_or_a_placeholder(monkeypatch, caplog) -> None:
    def args(token: str | None) -> argparse.Namespace:
        return argparse.Namespace(cluster_token=token, cluster_token_file=None)

    monkeypatch.delenv("KVRELAY_CLUSTER_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvrelay.common.options"):
        assert cluster_token_from_args(args(TOKEN)) == TOKEN
        assert ["`ps`" in r.getMessage() for r in caplog.records] == [True]
        caplog.clear()
        monkeypatch.setenv("KVRELAY_CLUSTER_TOKEN", TOKEN)  # from the environment: quiet
        assert cluster_token_from_args(args(TOKEN)) == TOKEN
        assert cluster_token_from_args(args(None)) is None
        assert not caplog.records
        monkeypatch.setenv("KVRELAY_CLUSTER_TOKEN", "demo-cluster-token-CHANGE-ME")
        cluster_token_from_args(args("demo-cluster-token-CHANGE-ME"))
        [r] = caplog.records
        assert "public placeholder" in r.getMessage() and "CHANGE-ME" not in r.getMessage()


@pytest.mark.parametrize(("host", "token", "warned"), [
    ("0.0.0.0", None, True), ("10.1.2.3", None, True), ("worker.svc", None, True),
    ("::", None, True), ("0.0.0.0", TOKEN, False), ("127.0.0.1", None, False),
    ("::1", None, False), ("[::1]", None, False), ("localhost", None, False),
])
def test_a_worker_port_beyond_loopback_without_a_token_is_loud(
        caplog, host: str, token: str | None, warned: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrelay.common.options"):
        assert warn_if_exposed_without_token("worker control port", host, 50060, token) is warned
    assert any("WITHOUT a cluster token" in r.getMessage() for r in caplog.records) is warned


@pytest.mark.slow
def test_router_and_worker_take_the_token_from_a_file(demo_model_dir, tmp_path: Path) -> None:
    """The way the manifests start them: KVRELAY_CLUSTER_TOKEN_FILE (the flag's variable) names
    the mounted Secret. The worker joins only if it read the router's token, the control port
    refuses callers without it, and no process's command line or environment holds it."""
    secret = tmp_path / "secrets" / "cluster-token"
    secret.parent.mkdir()
    secret.write_text(TOKEN + "\n")
    with Cluster(demo_model_dir, tmp_path / "work", prefill=0, decode=1,
                 cluster_token_file=secret) as c:
        assert {w.info.worker_id for w in c.registered()} == {"decode-1"}  # with the token
        with grpc.insecure_channel(c.control_address) as ch:
            for md in ((), ((CLUSTER_TOKEN_KEY, TOKEN[:-1]),)):
                with pytest.raises(grpc.RpcError) as e:
                    worker_pb2_grpc.RegistryStub(ch).ListWorkers(
                        wpb.ListWorkersRequest(), metadata=md, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for p in c.procs:
            for part in ("cmdline", "environ"):
                blob = Path(f"/proc/{p.popen.pid}/{part}").read_bytes()
                assert TOKEN.encode() not in blob, (p.name, part)


# -- locked memory --------------------------------------------------------------------------------
def test_worker_raises_its_memlock_limit_and_warns_beside_rdma_devices(tmp_path: Path,
                                                                     caplog) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lowered = 64 * 1024 if hard == resource.RLIM_INFINITY else min(64 * 1024, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (lowered, hard))
    try:
        with caplog.at_level(logging.WARNING, logger="kvrelay.cli"):
            assert raise_memlock_limit(str(tmp_path / "absent")) == hard
            assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == (hard, hard)
            assert not caplog.records  # no RDMA device: nothing to say
            raise_memlock_limit(str(tmp_path))  # an RDMA device directory exists
        warned = [r.getMessage() for r in caplog.records]
        assert bool(warned) is (hard != resource.RLIM_INFINITY), warned
        assert all("LimitMEMLOCK" in w for w in warned)
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
