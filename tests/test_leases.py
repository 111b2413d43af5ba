"""The decode worker's lease table: release by id or by request, abandonment, expiry."""

from __future__ import annotations

import asyncio

from kvrelay.decode_worker.leases import LeaseTable


def _table(freed: list[str], **kw: float) -> LeaseTable:
    async def free(request_id: str) -> None:
        freed.append(request_id)

    return LeaseTable(free, **kw)


def test_release_needs_the_lease_id_or_an_empty_one_for_a_lease_not_decoding() -> None:
    async def main() -> None:
        freed: list[str] = []
        t = _table(freed)
        a = t.create("a", 10.0)
        assert not await t.release("a", "not-its-id")
        assert await t.release("a", a.lease_id)
        t.create("b", 10.0)
        assert await t.release("b", "")  # the caller never read the id
        c = t.create("c", 10.0)
        t.start_decoding("c", c.lease_id)
        assert not await t.release("c", "")  # its Decode stream holds it now
        assert not await t.release("missing", "")
        assert freed == ["a", "b"] and len(t) == 1

    asyncio.run(main())


def test_an_abandoned_lease_is_freed_at_the_next_reap_not_at_its_ttl() -> None:
    async def main() -> None:
        freed: list[str] = []
        t = _table(freed, reap_interval_s=0.01)
        t.start()
        try:
            a = t.create("a", 3600.0)
            kept = t.create("kept", 3600.0)
            d = t.create("d", 3600.0)
            t.start_decoding("d", d.lease_id)
            t.abandon("a", "another-lease")  # not this lease: nothing happens
            t.abandon("d", d.lease_id)  # decoding: the stream ends it, not abandonment
            await asyncio.sleep(0.1)
            assert freed == []
            t.abandon("a", a.lease_id)
            for _ in range(100):
                if freed:
                    break
                await asyncio.sleep(0.01)
            assert freed == ["a"]
            assert t.num_expired == 0  # abandoned, not expired
            assert t.lease_of("kept") is kept and t.lease_of("d") is d
        finally:
            await t.stop()

    asyncio.run(main())


def test_an_unrenewed_lease_expires() -> None:
    async def main() -> None:
        freed: list[str] = []
        after: list[str] = []
        t = _table(freed, reap_interval_s=0.01)

        async def after_free(request_id: str) -> None:
            after.append(request_id)

        t.after_free = after_free
        t.start()
        try:
            t.create("a", 0.05)
            for _ in range(200):
                if after:
                    break
                await asyncio.sleep(0.01)
            assert freed == after == ["a"] and t.num_expired == 1
        finally:
            await t.stop()

    asyncio.run(main())
