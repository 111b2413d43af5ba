"""A worker that leaves the router's registry leaves nothing behind: its routing counters and
their metric series go with it (pods come and go; the router's memory and /metrics must not
grow with every one that ever existed). A restarted worker keeps its series."""

from __future__ import annotations

import asyncio

from kvrelay.proto import worker_pb2 as wpb
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.registry import WorkerRegistry


def _beat(worker_id: str, incarnation: str = "i1") -> wpb.HeartbeatRequest:
    return wpb.HeartbeatRequest(
        worker=wpb.WorkerInfo(worker_id=worker_id, role=wpb.ROLE_DECODE,
                              address="127.0.0.1:9", incarnation=incarnation, block_size=16,
                              max_model_len=4096),
        load=wpb.WorkerLoad(num_blocks=64, free_blocks=64))


def test_a_departed_workers_counters_and_series_are_pruned() -> None:
    async def main() -> None:
        reg = WorkerRegistry(heartbeat_interval_s=0.05)
        metrics = RouterMetrics(reg, "m")
        reg.start()
        try:
            reg.heartbeat(_beat("gone-1"))
            reg.heartbeat(_beat("stays-1"))
            gone = reg.workers["gone-1"]
            reg.counter(gone).kv_blocks_sent += 7
            reg.counter(reg.workers["stays-1"]).kv_blocks_sent += 3
            assert b'worker="gone-1"' in metrics.render()
            for _ in range(20):  # stays-1 keeps beating; gone-1 falls silent
                reg.heartbeat(_beat("stays-1"))
                await asyncio.sleep(0.05)
            assert "gone-1" not in reg.workers
            reg.counter(gone).kv_blocks_sent += 1  # a request still finishing on it
            assert [k[1] for k in reg.counters] == ["stays-1"]
            text = metrics.render()
            assert b'worker="gone-1"' not in text and b'worker="stays-1"' in text
            # a restart (new incarnation, same id) is the same worker: its counters go on
            reg.heartbeat(_beat("stays-1", "i2"))
            assert reg.counter(reg.workers["stays-1"]).kv_blocks_sent == 3
        finally:
            await reg.stop()

    asyncio.run(main())
