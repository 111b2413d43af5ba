"""common.gc_tuning: a serving process's collector after startup."""

from __future__ import annotations

import gc

import pytest

from kvrelay.common.gc_tuning import DEFAULT_GEN0, settle_after_startup


@pytest.fixture
def restore_gc():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_freezes_the_startup_heap_and_raises_gen0(restore_gc, monkeypatch) -> None:
    monkeypatch.delenv("KVRELAY_GC_GEN0", raising=False)
    gc.set_threshold(700, 10, 10)
    long_lived = [{"startup": i} for i in range(1000)]
    settle_after_startup()
    assert gc.get_freeze_count() >= len(long_lived)
    assert gc.get_threshold() == (DEFAULT_GEN0, 10, 10)
    # cycles made after startup are still collected
    a: list = []
    a.append(a)
    del a
    assert gc.collect() >= 1


def test_env_sets_or_disables_it(restore_gc, monkeypatch) -> None:
    gc.set_threshold(700, 10, 10)
    monkeypatch.setenv("KVRELAY_GC_GEN0", "0")
    settle_after_startup()
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    monkeypatch.setenv("KVRELAY_GC_GEN0", "5000")
    settle_after_startup()
    assert gc.get_threshold() == (5000, 10, 10)
    monkeypatch.setenv("KVRELAY_GC_GEN0", "many")
    with pytest.raises(ValueError, match="KVRELAY_GC_GEN0"):
        settle_after_startup()


def test_never_lowers_a_higher_threshold(restore_gc, monkeypatch) -> None:
    monkeypatch.delenv("KVRELAY_GC_GEN0", raising=False)
    gc.set_threshold(100_000, 10, 10)
    settle_after_startup()
    assert gc.get_threshold()[0] == 100_000
