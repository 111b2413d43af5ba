"""The sender's self-fence (``kv_transfer.self_fence``), the KV timing contract the worker's flags
are checked against, and gRPC keepalive on every server and channel."""

from __future__ import annotations

import pytest

from kvrelay.common.kv_timing import (
    KV_SELF_FENCE_S,
    KV_SENDER_GRACE_S,
    KV_WRITE_TIMEOUT_S,
    check_kv_timing,
    kv_timing_defaults,
)
from kvrelay.common.rpc import CHANNEL_OPTIONS, SERVER_OPTIONS
from kvrelay.kv_transfer.self_fence import SelfFence
from kvrelay.worker.settings import WorkerSettings


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_no_proof_no_write_and_a_proof_lasts_its_horizon() -> None:
    clock = Clock()
    f = SelfFence(2.0, clock)
    assert f.admit() is None  # no router has answered yet
    f.proved(clock.t)
    epoch = f.admit()
    assert epoch is not None and f.valid(epoch)
    clock.t += 1.9
    assert f.valid(epoch)
    clock.t += 0.2  # 2.1 s after the beat went out: fenced
    assert not f.valid(epoch) and f.admit() is None


def test_a_lapse_is_final_for_what_came_before_it() -> None:
    clock = Clock()
    f = SelfFence(2.0, clock)
    f.proved(clock.t)
    old = f.admit()
    clock.t += 10  # stopped: no beat answered for 10 s
    f.proved(clock.t)  # the first beat after it
    assert not f.valid(old)  # never again, though a router lists us now
    assert f.admit() is None  # and new work settles for a horizon (destinations sent meanwhile)
    for _ in range(3):  # beats each second again
        clock.t += 1.0
        f.proved(clock.t)
    new = f.admit()
    assert new is not None and new != old and f.valid(new)
    assert f.num_lapses == 1


def test_a_lapse_seen_only_by_the_next_proof_still_counts() -> None:
    clock = Clock()
    f = SelfFence(2.0, clock)
    f.proved(clock.t)
    old = f.admit()
    clock.t += 5
    f.proved(clock.t - 0.001)  # nobody checked during the gap: the beat's send time tells
    assert not f.valid(old)


def test_beats_in_time_keep_the_epoch() -> None:
    clock = Clock()
    f = SelfFence(2.0, clock)
    f.proved(clock.t)
    epoch = f.admit()
    for _ in range(20):
        clock.t += 1.0
        f.proved(clock.t)
        assert f.valid(epoch)
    assert f.num_lapses == 0


def test_disabled_without_routers() -> None:
    f = SelfFence(None)
    assert f.admit() == 0 and f.valid(0) and not f.enabled


def test_the_defaults_keep_every_write_inside_the_grace() -> None:
    assert KV_SELF_FENCE_S + KV_WRITE_TIMEOUT_S < KV_SENDER_GRACE_S
    for grace in (1.0, 3.0, 4.0, 10.0, 60.0):
        g, fence, write = kv_timing_defaults(grace)
        assert g == grace and fence + write < grace
        check_kv_timing(g, write, fence)


def test_flags_are_checked_against_each_other() -> None:
    with pytest.raises(ValueError, match=r"--kv-self-fence .* --kv-write-timeout .* shorter "
                                          r"than --kv-sender-grace"):
        WorkerSettings(role="prefill", kv_sender_grace_s=10, kv_self_fence_s=6,
                       kv_write_timeout_s=4)
    with pytest.raises(ValueError, match="--kv-sender-grace"):  # the old defaults: 10 s each
        WorkerSettings(role="decode", kv_sender_grace_s=10, kv_write_timeout_s=10)
    with pytest.raises(ValueError, match="--heartbeat-interval"):
        WorkerSettings(role="prefill", kv_sender_grace_s=2.0)  # fence 1 s = one beat
    assert WorkerSettings(role="prefill").kv_timing() == (10.0, 5.0, 4.0)
    assert WorkerSettings(role="prefill", kv_sender_grace_s=4).kv_timing() == (4.0, 2.0, 1.6)


def test_connector_config_refuses_a_write_timeout_as_long_as_the_grace() -> None:
    pytest.importorskip("nixl")
    from kvrelay.kv_transfer.config import NixlConnectorConfig

    with pytest.raises(ValueError, match="--kv-sender-grace"):
        NixlConnectorConfig("a", "m", write_timeout_s=10.0, sender_gone_grace_s=10.0,
                            self_fence_s=5.0)
    NixlConnectorConfig("a", "m", self_fence_s=5.0)  # the defaults hold


def test_keepalive_on_every_channel_and_server() -> None:
    ch, srv = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    for opts in (ch, srv):
        assert opts["grpc.keepalive_time_ms"] > 0 and opts["grpc.keepalive_timeout_ms"] > 0
        assert opts["grpc.keepalive_permit_without_calls"] == 1
    # A server accepts its clients' pings: never more often than they send them.
    assert srv["grpc.http2.min_recv_ping_interval_without_data_ms"] <= ch["grpc.keepalive_time_ms"]
    assert srv["grpc.http2.min_ping_interval_without_data_ms"] <= ch["grpc.keepalive_time_ms"]
