"""Send plans and per-request bookkeeping of the KV connector: pure Python, no NIXL."""

from __future__ import annotations

import random

import pytest

from kvrelay.kv_transfer.descriptors import plane_block_indices, plane_indices, region_descs
from kvrelay.kv_transfer.layout import KVLayout
from kvrelay.kv_transfer.messages import KVDestination
from kvrelay.kv_transfer.notice import Notice, NoticeKind, decode, encode
from kvrelay.kv_transfer.recv_tracker import Quarantine, RecvTracker
from kvrelay.kv_transfer.send_plan import BlockRange, blocks_to_send, map_blocks
from kvrelay.kv_transfer.send_tracker import NotifJob, SendTracker

BS = 16


def done(key: bytes) -> Notice:
    return Notice(key, NoticeKind.DONE)


def aborted(key: bytes) -> Notice:
    return Notice(key, NoticeKind.ABORTED)


def done_msg(key: bytes) -> bytes:
    return encode(key, NoticeKind.DONE)


def plan(start: int, n: int, prompt: int, covered: int, skip: int = 0) -> BlockRange:
    return blocks_to_send(start, n, prompt, BS, covered, skip)


def test_first_chunk_sends_every_touched_block_including_the_partial_one() -> None:
    assert plan(0, 40, 100, covered=0) == BlockRange(0, 3, 2)


def test_next_chunk_resends_the_partial_block_it_fills() -> None:
    assert plan(40, 30, 100, covered=2) == BlockRange(2, 5, 4)


def test_blocks_from_our_prefix_cache_go_on_the_first_step() -> None:
    # 32 tokens were cached here (2 blocks); the peer has 1 block cached (skip=1).
    assert plan(32, 10, 42, covered=1, skip=1) == BlockRange(1, 3, 2)


def test_blocks_the_peer_has_are_never_written_even_if_we_computed_them() -> None:
    assert plan(16, 50, 66, covered=3, skip=3) == BlockRange(3, 5, 4)


def test_everything_cached_at_the_peer_sends_nothing() -> None:
    rng = plan(31, 1, 32, covered=2, skip=2)
    assert rng.start == rng.end


def test_decode_tokens_are_not_sent() -> None:
    assert plan(70, 1, 70, covered=4).start == plan(70, 1, 70, covered=4).end


def test_recompute_after_preemption_fills_a_gap_the_prefix_cache_left() -> None:
    # blocks [0, 2) were sent; after preemption the prefix cache gave back 4 blocks
    assert plan(64, 10, 74, covered=2) == BlockRange(2, 5, 4)


def test_random_chunkings_send_every_block_exactly_where_it_belongs() -> None:
    rnd = random.Random(0)
    for _ in range(300):
        prompt = rnd.randint(1, 200)
        nblocks = -(-prompt // BS)
        skip = rnd.randint(0, nblocks)
        cached = rnd.randint(0, (prompt - 1) // BS) * BS  # full blocks, never the last token
        covered, s = skip, cached
        last_write: dict[int, int] = {}  # block -> token count it held when last sent
        while s < prompt:
            n = rnd.randint(1, prompt - s)
            rng = plan(s, n, prompt, covered, skip)
            assert rng.start >= skip
            for i in range(rng.start, rng.end):
                last_write[i] = min(s + n, prompt)
            covered, s = rng.covered, s + n
        for i in range(skip, nblocks):  # every block the peer lacks arrives complete
            assert last_write.get(i, 0) >= min((i + 1) * BS, prompt), (prompt, skip, cached, i)
        assert all(i >= skip for i in last_write)


def test_map_blocks_pairs_local_and_remote_and_refuses_short_reservations() -> None:
    bm = map_blocks([7, 8, 9], [70, 80, 90], BlockRange(1, 3, 2))
    assert bm.local == [8, 9] and bm.remote == [80, 90]
    with pytest.raises(ValueError, match="reserved 2 blocks"):
        map_blocks([7, 8, 9], [70, 80], BlockRange(0, 3, 3))


def test_a_chunk_inside_the_peers_prefix_sends_nothing_whatever_is_allocated() -> None:
    """A prefill chunk that ends before the decode worker's own cached prefix does (the decode
    side holds more of a later turn than the prefill side): nothing to send, and the blocks the
    sequence has not allocated yet past the chunk are no error. Found by the multi-round QA
    benchmark: tokens [992, 3040) of a 3120-token prompt, the peer holding 191 blocks, failed
    the request with "sequence has 190 blocks, step needs 191"."""
    rng = blocks_to_send(992, 2048, 3120, BS, covered=191, skip_blocks=191)
    assert rng.start == rng.end == 191
    bm = map_blocks(list(range(190)), list(range(1000, 1195)), rng)
    assert bm.local == [] and bm.remote == []


def test_plane_indices_follow_the_tensor_order() -> None:
    assert plane_indices([0, 1, 4, 5], [2, 3], num_blocks=10) == [2, 3, 12, 13, 42, 43, 52, 53]
    big = list(range(0, 600, 2))
    assert list(plane_block_indices([1, 3], big, 1000)) == plane_indices([1, 3], big, 1000)


def test_descriptor_rows_match_the_byte_offsets_of_the_spec() -> None:
    lay = KVLayout(3, 2, 8, 4, 10, "bfloat16", "m")
    d = region_descs(0x1000, lay, 0)
    for layer, kv, block in ((0, 0, 0), (1, 1, 7), (2, 0, 9)):
        row = plane_indices([layer * 2 + kv], [block], lay.num_blocks)[0]
        assert d[row, 0] == 0x1000 + lay.spec.plane_block_offset(layer, kv, block)
        assert d[row, 1] == lay.block_bytes


# -- SendTracker -----------------------------------------------------------------------------
def dest(n: int = 4, skip: int = 0) -> KVDestination:
    return KVDestination("decode-0", list(range(100, 100 + n)), skip, b"n-" + bytes([n]))


def test_notification_only_when_finished_and_nothing_in_flight() -> None:
    t, d = SendTracker(), dest()
    pw = t.plan("r", d, [0, 1, 2, 3], 0, 40, 50, BS, "inc-1")
    assert pw is not None and pw.local == [0, 1, 2] and pw.remote == [100, 101, 102]
    assert pw.incarnation == "inc-1"
    t.posted(["r"])
    t.posted(["r"])
    assert t.write_done(["r"]) == []
    assert t.finish("r", d, aborted=False) == []  # one write still in flight
    assert t.has_pending()
    assert t.write_done(["r"]) == [NotifJob("r", "decode-0", done_msg(d.notif), "inc-1")]
    assert t.take().sent == []  # not before the notification went out
    t.notif_done("r", None)
    assert t.take() == (["r"], [])
    assert not t.has_pending() and t.num_tracked() == 0


def test_notification_at_finish_when_all_writes_are_already_done() -> None:
    t, d = SendTracker(), dest()
    t.plan("r", d, [0, 1, 2, 3], 0, 50, 50, BS)
    t.posted(["r"])
    t.write_done(["r"])
    assert not t.has_pending()  # still running in the engine: the engine steps anyway
    assert t.finish("r", d, aborted=False) == [NotifJob("r", "decode-0", done_msg(d.notif), None)]


def test_a_request_stays_bound_to_the_peer_incarnation_it_reserved_at() -> None:
    t = SendTracker()
    named = KVDestination("decode-0", [1, 2, 3], 0, b"x", incarnation="inc-old")
    assert t.plan("a", named, [0, 1, 2], 0, 16, 40, BS, "inc-new").incarnation == "inc-old"
    d = dest()
    assert t.plan("b", d, [0, 1, 2, 3], 0, 16, 50, BS, "inc-1").incarnation == "inc-1"
    # the peer restarted meanwhile: later chunks still name the first incarnation
    assert t.plan("b", d, [0, 1, 2, 3], 16, 16, 50, BS, "inc-2").incarnation == "inc-1"


def test_a_failed_write_means_no_notification_and_failed_then_sent() -> None:
    t, d = SendTracker(), dest()
    t.plan("r", d, [0, 1, 2, 3], 0, 16, 50, BS)
    t.posted(["r"])
    t.posted(["r"])
    assert t.write_failed(["r"], "peer died") == []
    assert t.plan("r", d, [0, 1, 2, 3], 16, 16, 50, BS) is None  # no more writes for it
    assert t.finish("r", d, aborted=False) == []
    assert t.take() == ([], [])  # a write still reads the blocks
    assert t.write_done(["r"]) == []
    assert t.take() == (["r"], [("r", "peer died")])


def test_abort_reports_failed_and_sent_once_writes_drain() -> None:
    t, d = SendTracker(), dest()
    t.plan("r", d, [0, 1, 2, 3], 0, 16, 50, BS)
    t.posted(["r"])
    assert t.finish("r", d, aborted=True) == []
    assert t.take() == ([], [])
    # Only once the last write ended does the receiver hear of the abort (and may reuse blocks).
    [notice] = t.write_done(["r"])
    assert notice.notif == encode(d.notif, NoticeKind.ABORTED) and notice.peer == d.peer
    assert t.take() == ([], [])
    t.notif_done("r", None)
    sent, failed = t.take()
    assert sent == ["r"] and failed[0][0] == "r" and "aborted" in failed[0][1]


def test_abort_before_any_step_sends_the_notice_at_once() -> None:
    t, d = SendTracker(), dest()
    [notice] = t.finish("r", d, aborted=True)
    assert decode(notice.notif).kind is NoticeKind.ABORTED
    t.notif_done("r", "peer unknown")  # a notice that cannot go out changes nothing
    sent, failed = t.take()
    assert sent == ["r"] and "aborted" in failed[0][1]


def test_a_failed_notification_is_reported() -> None:
    t, d = SendTracker(), dest()
    [job] = t.finish("r", d, aborted=False)
    t.notif_done(job.request_id, "peer gone")
    assert t.take() == (["r"], [("r", "peer gone")])


def test_writes_shared_by_requests_count_for_each() -> None:
    t, da, db = SendTracker(), dest(2), dest(3)
    t.plan("a", da, [0, 1], 0, 20, 20, BS)
    t.plan("b", db, [2, 3, 4], 0, 40, 40, BS)
    t.posted(["a", "b"])
    t.finish("a", da, aborted=False)
    t.finish("b", db, aborted=False)
    jobs = t.write_done(["a", "b"])
    assert [j.request_id for j in jobs] == ["a", "b"]


def test_a_reservation_too_short_fails_the_request() -> None:
    t, d = SendTracker(), dest(1)
    assert t.plan("r", d, [0, 1], 0, 20, 20, BS) is None
    t.finish("r", d, aborted=False)
    sent, failed = t.take()
    assert sent == ["r"] and "reserved 1 blocks" in failed[0][1]


# -- RecvTracker -----------------------------------------------------------------------------
def test_receiver_matches_each_notification_once_and_drops_strays() -> None:
    t = RecvTracker()
    t.expect("a", b"na", None)
    t.expect("b", b"nb", None)
    assert t.has_pending()
    t.on_notif("p", b"nb")
    t.on_notif("p", b"nb")  # duplicate: dropped
    t.on_notif("p", b"zz")  # stray: dropped
    assert t.take() == (["b"], [])
    assert t.forget("a") and not t.forget("a")
    t.on_notif("p", b"na")  # stale: its request is gone
    assert t.take() == ([], []) and not t.has_pending()


def test_receiver_expectations_expire() -> None:
    t = RecvTracker()
    t.expect("a", b"na", 10.0)
    t.expect("b", b"nb", None)
    t.expire(9.0)
    assert t.take() == ([], [])
    t.expire(10.0)
    _, failed = t.take()
    assert failed == [("a", "KV did not arrive before the deadline")] and t.has_pending()


def test_receiver_refuses_one_notification_for_two_requests() -> None:
    t = RecvTracker()
    t.expect("a", b"n", None)
    with pytest.raises(ValueError, match="unique"):
        t.expect("b", b"n", None)


def test_quarantine_ends_with_the_senders_last_notification_whichever_it_is() -> None:
    """An aborted receiver's blocks are held until its sender is done: an abort notice, or the
    completion of a send that finished before the abort reached it. Time alone releases
    nothing before the backstop, however long the sender takes."""
    q = Quarantine()
    q.hold("a", b"n-a", "p1", backstop=1000.0)
    q.hold("b", b"n-b", "p1", backstop=1000.0)
    q.hold("c", b"n-c", "p1", backstop=1000.0)
    assert q.release_due(2.5) == [] and q.release_due(900.0) == []
    assert q.on_notif("p1", aborted(b"n-a"))  # aborted sender, last write ended
    assert q.on_notif("p1", done(b"n-b"))  # completed sender: no write of it is left either
    assert not q.on_notif("p1", done(b"n-other"))  # an expectation's notification: not ours
    assert q.on_notif("p1", aborted(b"n-gone"))  # a late notice is consumed, not expected
    assert sorted(q.release_due(900.0)) == ["a", "b"]
    assert q  # c still held
    assert q.release_due(1000.0) == ["c"] and q.num_backstopped == 1
    assert not q and not q.on_notif("p1", done(b"n-c"))
    assert q.ended == {"notice": 2, "backstop": 1}


def test_quarantine_hears_only_the_sender_its_blocks_were_promised_to() -> None:
    q = Quarantine()
    q.hold("a", b"n-a", "p1", backstop=1000.0)
    assert q.on_notif("intruder", aborted(b"n-a"))  # consumed, and counted, not obeyed
    assert q.on_notif("intruder", done(b"n-a"))
    assert q.num_foreign == 2 and q.release_due(1.0) == [] and q
    assert q.on_notif("p1", aborted(b"n-a"))
    assert q.release_due(1.0) == ["a"]


def test_quarantine_ends_when_the_control_plane_settles_it_or_the_sender_is_gone() -> None:
    q = Quarantine()
    q.hold("a", b"n-a", "p1", backstop=1000.0)
    q.hold("b", b"n-b", "p2", backstop=1000.0)
    q.hold("c", b"n-c", None, backstop=1000.0)  # unbound: never "gone", settled or notified
    assert q.settle("c") and not q.settle("c") and not q.settle("unknown")
    assert q.release_due(0.0) == ["c"]
    q.observe_alive({"p1", "p2"}, now=10.0, grace_s=5.0)
    q.observe_alive({"p1"}, now=11.0, grace_s=5.0)  # p2 missing from every router's list ...
    q.observe_alive({"p1", "p2"}, now=13.0, grace_s=5.0)  # ... back: the grace starts over
    q.observe_alive({"p1"}, now=14.0, grace_s=5.0)
    q.observe_alive({"p1"}, now=18.9, grace_s=5.0)
    assert q.release_due(18.9) == []
    q.observe_alive({"p1"}, now=19.0, grace_s=5.0)
    assert q.release_due(19.0) == ["b"]
    assert q.release_due(500.0) == [] and q  # p1 is alive and silent: a is still held
    assert q.ended == {"settled": 1, "sender_gone": 1} and q.num_held == 1


def test_receiver_completes_only_on_the_promised_senders_notification() -> None:
    t = RecvTracker()
    t.expect("a", b"n-a", None, sender="p1")
    t.expect("b", b"n-b", None)  # unbound: any sender
    t.on_notif("intruder", b"n-a")
    t.on_notif("p9", b"n-b")
    assert t.take() == (["b"], []) and t.num_foreign == 1 and t.has_pending()
    assert t.bind("a", "p2") and not t.bind("nothing", "p2")  # the prefill moved to p2
    t.on_notif("p1", b"n-a")
    assert t.take() == ([], []) and t.num_foreign == 2
    t.on_notif("p2", b"n-a")
    assert t.take() == (["a"], []) and not t.has_pending()


def test_absence_counts_only_across_continuous_observation() -> None:
    """A gap in what the receiver heard from the routers (its beats failed, a router went
    quiet) may hide a time the sender was listed, and so proved itself alive and kept writing:
    the absence restarts after such a gap instead of spanning it."""
    q = Quarantine()
    q.hold("a", b"n-a", "p1", backstop=1000.0)
    q.observe_alive(set(), now=10.0, grace_s=5.0)  # absent from here ...
    q.observe_alive(set(), now=16.0, grace_s=5.0, continuous=False)  # ... but unheard meanwhile
    assert q.release_due(16.0) == [] and q.num_held == 1
    q.observe_alive(set(), now=20.9, grace_s=5.0)
    assert q.release_due(20.9) == []
    q.observe_alive(set(), now=21.0, grace_s=5.0)  # 5 s of absence, all of it observed
    assert q.release_due(21.0) == ["a"] and q.ended == {"sender_gone": 1}
