"""The versioned KV layout handshake at registration: a worker whose KV layout (model, block
size, KV dtype, prefix-hash scheme) differs from that of the workers a router routes to, or
that hashes prefixes unlike the router, is refused (FAILED_PRECONDITION) with a message naming
the field and both values, and logs it at ERROR, instead of joining to serve zero prefix hits
(or, a prefill worker of another KV dtype than the decode pool's, to serve nothing).

A real registry; real beats over real gRPC from the worker's Heartbeater; and once, real
worker processes whose KV dtypes differ."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc
import pytest

from kvrelay.common.kv_layout import (
    HASH_SCHEME,
    LAYOUT_VERSION,
    CacheLayout,
    KVLayoutMismatch,
    hash_probe,
)
from kvrelay.engine.prefix_hash import ROOT_HASH, block_hashes, salt_root
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc
from kvrelay.router.registry import WorkerRegistry
from kvrelay.worker.heartbeat import Heartbeater

BS = 16
F32 = CacheLayout.local("llama:abc", BS, "float32")


def beat(wid: str, layout: CacheLayout | None = F32, *, role: int = wpb.ROLE_DECODE,
         incarnation: str = "i1") -> wpb.HeartbeatRequest:
    info = wpb.WorkerInfo(worker_id=wid, role=role, address=f"{wid}.local:9",
                          incarnation=incarnation, max_model_len=4096,
                          model_identity=layout.model_identity if layout else "llama:abc",
                          block_size=layout.block_size if layout else BS)
    if layout is not None:
        info.kv_layout.CopyFrom(layout.to_proto())
    return wpb.HeartbeatRequest(worker=info, load=wpb.WorkerLoad(num_blocks=64, free_blocks=64))


def run(body: Callable[[WorkerRegistry], None], **kw: object) -> None:
    async def go() -> None:
        reg = WorkerRegistry(**kw)  # type: ignore[arg-type]
        try:
            body(reg)
        finally:
            await reg.stop()
    asyncio.run(go())


def test_the_local_layout_names_this_builds_hashing() -> None:
    assert (F32.hash_scheme, F32.version) == (HASH_SCHEME, LAYOUT_VERSION)
    # the probe is the engine's prefix hash of one block, unsalted and under a salt: it
    # changes with the hash, the unsalted root (the seed) or the salt's derivation
    probe = list(range(1, 17))
    assert F32.hash_probe == (block_hashes(probe, 16, ROOT_HASH)[-1]
                              ^ block_hashes(probe, 16, salt_root("kvrelay-layout-probe"))[-1])
    assert F32.hash_probe == hash_probe() != 0
    assert CacheLayout.from_info(beat("d1").worker) == F32
    assert CacheLayout.from_info(beat("d1", None).worker) is None


def test_a_prefill_worker_of_another_kv_dtype_is_refused_naming_both(caplog) -> None:
    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(beat("d1"))
        bf16 = dataclasses.replace(F32, kv_dtype="bfloat16")
        with caplog.at_level(logging.ERROR, "kvrelay.router.registry"), \
                pytest.raises(KVLayoutMismatch) as e:
            reg.heartbeat(beat("p1", bf16, role=wpb.ROLE_PREFILL))
        msg = str(e.value)
        assert "kv_dtype" in msg and "'bfloat16' on worker p1" in msg
        assert "'float32' on the workers this router routes to (d1)" in msg
        assert "--kv-cache-dtype" in msg
        assert "p1" not in reg.workers and reg.alive("prefill") == []
        assert [r.getMessage() for r in caplog.records] == [msg]  # the router's log too
        # refused again each beat, logged once per reason
        with pytest.raises(KVLayoutMismatch):
            reg.heartbeat(beat("p1", bf16, role=wpb.ROLE_PREFILL))
        assert len(caplog.records) == 1
        # the same layout joins
        reg.heartbeat(beat("p1", role=wpb.ROLE_PREFILL))
        assert "p1" in reg.workers and reg.workers["p1"].identity.kv_layout == F32
    run(body)


@pytest.mark.parametrize("field, value, shown", [
    ("block_size", 32, "block_size (tokens per KV block) differs: 32 on worker d2, 16 on"),
    ("model_identity", "llama:def", "model_identity (model) differs: 'llama:def' on worker d2"),
    ("block_order", "heads", "block_order (order of a KV block: 'tokens' or 'heads' first) "
                             "differs: 'heads' on worker d2, 'tokens' on"),
    ("kv_pages", "k=2;windows=full,4", "kv_pages (KV block addressing: '' one table, else the "
                                       "hybrid layout's layer groups) differs"),
    ("version", LAYOUT_VERSION + 1, f"version (of this handshake) differs: {LAYOUT_VERSION + 1}"
                                    f" on worker d2, {LAYOUT_VERSION} on"),
])
def test_each_layout_field_is_checked_against_the_registered_workers(field, value,
                                                                      shown) -> None:
    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(beat("d1"))
        with pytest.raises(KVLayoutMismatch, match="registration refused") as e:
            reg.heartbeat(beat("d2", dataclasses.replace(F32, **{field: value})))
        assert shown in str(e.value)
        assert list(reg.workers) == ["d1"]
    run(body)


def test_hashing_unlike_the_router_is_refused_even_as_the_first_worker() -> None:
    def body(reg: WorkerRegistry) -> None:
        other = dataclasses.replace(F32, hash_scheme="xxh3-chain-v1")
        with pytest.raises(KVLayoutMismatch, match=r"hash_scheme .* 'xxh3-chain-v1' on worker "
                                                   r"d1, 'blake2b64-chain-v1' on this router"):
            reg.heartbeat(beat("d1", other))
        # the same scheme name, but it hashes differently: the probe tells
        renamed = dataclasses.replace(F32, hash_probe=F32.hash_probe ^ 1)
        with pytest.raises(KVLayoutMismatch, match=r"hash_probe .* on this router: run the "
                                                   r"same kvrelay version"):
            reg.heartbeat(beat("d1", renamed))
        assert reg.workers == {}
    run(body)


def test_the_reference_is_the_registered_workers_not_the_first_ever() -> None:
    def body(reg: WorkerRegistry) -> None:
        reg.heartbeat(beat("d1"))
        bf16 = dataclasses.replace(F32, kv_dtype="bfloat16")
        # the only worker restarts in bf16: nothing else to agree with
        reg.heartbeat(beat("d1", bf16, incarnation="i2"))
        assert reg.workers["d1"].identity.kv_layout == bf16
        with pytest.raises(KVLayoutMismatch):
            reg.heartbeat(beat("d2"))
        # a restart into a layout its peers do not share is refused; the old incarnation stays
        reg.heartbeat(beat("d2", bf16))
        with pytest.raises(KVLayoutMismatch):
            reg.heartbeat(beat("d2", incarnation="i2"))
        assert reg.workers["d2"].identity.incarnation == "i1"
        # the whole pool leaves: the next layout sets the reference
        for wid in ("d1", "d2"):
            b = beat(wid, bf16, incarnation=reg.workers[wid].identity.incarnation)
            b.leaving = True
            reg.heartbeat(b)
        reg.heartbeat(beat("d3"))
        assert reg.workers["d3"].identity.kv_layout == F32
        # a worker reporting no layout (a test double, a tool) is not checked
        reg.heartbeat(beat("d4", None))
        assert reg.workers["d4"].identity.kv_layout is None
    run(body)


def test_a_beat_with_an_oversized_layout_is_out_of_bounds() -> None:
    def body(reg: WorkerRegistry) -> None:
        with pytest.raises(ValueError, match="at most 64 characters"):
            reg.heartbeat(beat("d1", dataclasses.replace(F32, kv_dtype="f" * 65)))
        with pytest.raises(ValueError, match="needs a kv_dtype"):
            reg.heartbeat(beat("d1", dataclasses.replace(F32, kv_dtype="")))
        with pytest.raises(ValueError, match="block_order must be one of"):
            reg.heartbeat(beat("d1", dataclasses.replace(F32, block_order="sideways")))
        with pytest.raises(ValueError, match="kv_pages takes at most 2048"):
            reg.heartbeat(beat("d1", dataclasses.replace(F32, kv_pages="x" * 2049)))
    run(body)


def test_a_refused_worker_logs_the_routers_reason_at_error_and_joins_once_it_matches(
        caplog) -> None:
    """Over real gRPC: the registry's servicer answers FAILED_PRECONDITION with the reason; the
    worker's Heartbeater logs it at ERROR (not once per beat) and keeps beating."""
    from kvrelay.common.rpc import bind, make_server
    from kvrelay.router.grpc_api import RegistryServicer

    async def go() -> None:
        reg = WorkerRegistry(heartbeat_interval_s=0.05)
        server = make_server()
        worker_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(reg), server)
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        router = f"127.0.0.1:{port}"
        reg.heartbeat(beat("d1"))
        bf16 = beat("p1", dataclasses.replace(F32, kv_dtype="bfloat16"), role=wpb.ROLE_PREFILL)
        hb = Heartbeater([router], bf16.worker, lambda: bf16.load, interval_s=0.05)
        hb.start()
        try:
            deadline = time.monotonic() + 10
            while len([r for r in caplog.records if r.name == "kvrelay.worker.heartbeat"]) < 1:
                assert time.monotonic() < deadline, "no refusal logged"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # several more refused beats
            logged = [r for r in caplog.records if r.name == "kvrelay.worker.heartbeat"]
            assert len(logged) == 1 and logged[0].levelno == logging.ERROR
            line = logged[0].getMessage()
            assert "FAILED_PRECONDITION" in line and "kv_dtype" in line
            assert "'bfloat16' on worker p1" in line and "'float32'" in line
            assert "kv_dtype" in hb.refused[router] and "p1" not in reg.workers
            # the decode pool goes bf16 too (d1 restarts so): the worker joins
            reg.heartbeat(beat("d1", dataclasses.replace(F32, kv_dtype="bfloat16"),
                               incarnation="i2"))
            while "p1" not in reg.workers:
                assert time.monotonic() < deadline, "never joined"
                await asyncio.sleep(0.02)
            while hb.refused:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
        finally:
            await hb.stop()
            await server.stop(None)
            await reg.stop()

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())


@pytest.mark.slow
def test_a_prefill_process_of_another_kv_layout_is_refused_at_registration(
        demo_model_dir, tmp_path) -> None:
    """Real processes: a decode worker in the model's fp32, then a prefill worker started with
    --kv-cache-dtype bfloat16, and one with --kv-layout heads. Before the handshake such a
    worker registered and never served (each of its KV transfers was refused by the decode
    worker's layout check); now the router refuses it and its log says why."""
    from cluster import Cluster

    with Cluster(demo_model_dir, tmp_path, prefill=0, decode=1) as c:
        (d,) = c.registered()
        assert d.info.kv_layout.kv_dtype == "float32"
        assert d.info.kv_layout.block_order == "tokens" and d.info.kv_layout.kv_pages == ""
        assert d.info.kv_layout.hash_probe == hash_probe()
        p = c.add_worker("prefill", extra=("--kv-cache-dtype", "bfloat16"), wait=False)
        h = c.add_worker("prefill", extra=("--kv-layout", "heads", "--attention-backend",
                                           "sdpa"), wait=False)
        for w, field, shown in ((p, "kv_dtype", "'bfloat16' on worker prefill-1"),
                                (h, "block_order", "'heads' on worker prefill-2")):
            c.wait_ready(w)
            deadline = time.monotonic() + 30
            while field not in w.log.read_text():
                assert time.monotonic() < deadline, w.tail()
                time.sleep(0.1)
            text = w.log.read_text()
            assert "ERROR" in text and shown in text, text[-2000:]
        assert [w.info.worker_id for w in c.registered()] == [d.info.worker_id]
        with grpc.insecure_channel(c.control_address) as ch:
            status = worker_pb2_grpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(),
                                                                  timeout=10)
        assert [w.info.kv_layout.kv_dtype for w in status.workers] == ["float32"]
