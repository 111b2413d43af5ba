"""A prefill worker forgets decode workers nobody has sent to for ``PEER_IDLE_S`` (their NIXL
remote agent, descriptors and connection lock): decode pods come and go, and every one ever
seen was kept forever. One with a request under way is kept however long it takes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvrelay.prefill_worker.peers import PEER_IDLE_S, DecodePeers


class Engine:
    """The AsyncEngine's ``call``, run in place (no model: this is bookkeeping)."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


class Peers:
    def __init__(self) -> None:
        self.evicted: list[str] = []

    def evict_peer(self, agent_name: str) -> bool:
        self.evicted.append(agent_name)
        return True


def test_idle_decode_peers_are_evicted_busy_ones_kept() -> None:
    async def main() -> None:
        kv = Peers()
        s = DecodePeers(Engine(), kv)  # type: ignore[arg-type]
        now = time.monotonic()
        for name in ("gone", "busy", "recent"):
            s._locks[name] = asyncio.Lock()
        s._used.update(gone=now - PEER_IDLE_S - 1, busy=now - PEER_IDLE_S - 1, recent=now - 1)
        with s.using("busy"):  # a Prefill to it still under way
            s._used["busy"] = now - PEER_IDLE_S - 1
            assert await s.evict_idle(now) == ["gone"]
            assert kv.evicted == ["gone"]
            assert set(s._locks) == {"busy", "recent"} and "gone" not in s._used
        s._used["busy"] = now - PEER_IDLE_S - 1
        assert await s.evict_idle(now) == ["busy"]
        assert set(s._locks) == set(s._used) == {"recent"}

    asyncio.run(main())
