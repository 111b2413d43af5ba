"""The reader's side of a prefix pull (``prefill_worker/pull.py``) where the cluster test
cannot time it: a Prefill cancelled while its NIXL read runs in its thread waits for the read
to end before the import's blocks may be dropped (and reused by another request)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvrelay.prefill_worker.pull import _unabandoned


def test_a_cancelled_pull_waits_for_its_read_before_letting_go() -> None:
    async def go() -> None:
        ended = threading.Event()

        def read() -> int:
            time.sleep(0.3)
            ended.set()
            return 7

        task = asyncio.ensure_future(_unabandoned(asyncio.to_thread(read)))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()  # cancelled again meanwhile: still waits
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert ended.is_set(), "the blocks may be dropped only once the read ended"
        assert await _unabandoned(asyncio.to_thread(lambda: 5)) == 5

        def fails() -> int:
            raise ValueError("read failed")

        with pytest.raises(ValueError):
            await _unabandoned(asyncio.to_thread(fails))

    asyncio.run(go())


def test_worker_metrics_show_blocks_lent_read_and_dropped() -> None:
    from prometheus_client import generate_latest

    from kvrelay.engine.engine_types import EngineStats
    from kvrelay.worker.metrics import WorkerMetrics

    stats = EngineStats(num_blocks=100, num_free_blocks=60, num_running=0, num_waiting=0,
                        num_waiting_for_kv=0, num_sending=0, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_preemptions=0, waiting_prompt_tokens=0,
                        prefix_shares={"exported_blocks": 7, "imported_blocks": 5,
                                       "failed_imports": 1})
    text = generate_latest(WorkerMetrics(lambda: stats, "prefill", "p1").registry).decode()
    for event, n in (("exported_blocks", 7), ("imported_blocks", 5), ("failed_imports", 1)):
        assert (f'kvrelay:prefix_pull_blocks_total{{event="{event}",pool="prefill",'
                f'worker="p1"}} {float(n)}') in text, text
