"""What the router's control port believes: heartbeats out of bounds are refused with a message
(they would steer every request), against a real router process."""

from __future__ import annotations

import grpc
import pytest
from cluster import Cluster

from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc, worker_pb2_grpc
from kvrelay.proto import worker_pb2 as wpb

pytestmark = pytest.mark.slow

CONTEXT = 4096  # the demo model's


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    from kvrelay.engine.models.arch import load_model_config

    with Cluster(demo_model_dir, tmp_path_factory.mktemp("trust"), prefill=0, decode=0) as c:
        c.identity = load_model_config(demo_model_dir)[1].identity
        yield c


def _beat(c: Cluster, *, load: wpb.WorkerLoad | None = None, hashes: int = 0,
          **info: object) -> grpc.StatusCode | None:
    fields = {"worker_id": "w1", "role": wpb.ROLE_DECODE, "address": "127.0.0.1:9",
              "incarnation": "i1", "block_size": 16, "max_model_len": CONTEXT,
              "model_identity": c.identity, **info}
    req = wpb.HeartbeatRequest(worker=wpb.WorkerInfo(**fields),
                               load=load or wpb.WorkerLoad(num_blocks=64, free_blocks=64),
                               tiers=[wpb.TierBlocks(medium="device", added=range(hashes),
                                                     full=True)])
    with grpc.insecure_channel(c.control_address) as ch:
        try:
            worker_pb2_grpc.RegistryStub(ch).Heartbeat(req, timeout=10)
        except grpc.RpcError as e:
            assert len(e.details() or "") > 10, e.details()
            return e.code()
    return None


def _context(c: Cluster) -> int:
    with grpc.insecure_channel(c.address) as ch:
        return generate_pb2_grpc.GenerationStub(ch).ListModels(
            pb.ListModelsRequest(), timeout=10).models[0].max_model_len


@pytest.mark.parametrize("bad", [
    {"block_size": 0}, {"block_size": 1 << 20}, {"max_model_len": 2},
    {"worker_id": "a\nb"}, {"worker_id": "x" * 200}, {"address": "nowhere"},
    {"address": "h:" + "9" * 300}, {"incarnation": "i" * 1000},
    {"load": wpb.WorkerLoad(num_blocks=8, free_blocks=9)},
    {"load": wpb.WorkerLoad(num_blocks=1 << 30)},
    {"hashes": 65},  # more blocks hashed than the worker has
    {"drain_timeout_s": -1.0}, {"drain_timeout_s": float("nan")}, {"drain_timeout_s": 1e9},
])
def test_out_of_bounds_heartbeats_are_refused(cluster, bad) -> None:
    assert _beat(cluster, **bad) == grpc.StatusCode.FAILED_PRECONDITION
    assert cluster.registered() == []
    assert _context(cluster) == CONTEXT  # max_model_len=2 would have become the cluster's


def test_a_valid_heartbeat_is_taken(cluster) -> None:
    assert _beat(cluster, worker_id="ok-1", hashes=64) is None
    assert [w.info.worker_id for w in cluster.registered()] == ["ok-1"]


def test_a_live_worker_id_cannot_be_taken_from_another_address(cluster) -> None:
    """No cluster token here: a beat reusing a live worker's id from elsewhere would otherwise
    replace the real worker (its prompts would go to the sender)."""
    assert _beat(cluster, worker_id="held", address="127.0.0.1:9") is None
    assert _beat(cluster, worker_id="held", address="127.0.0.1:6666",
                 incarnation="thief") == grpc.StatusCode.ALREADY_EXISTS
    held = [w.info for w in cluster.registered() if w.info.worker_id == "held"]
    # (ListWorkers on a port without a cluster token shows no incarnation at all)
    assert [(i.address, i.incarnation) for i in held] == [("127.0.0.1:9", "")]
