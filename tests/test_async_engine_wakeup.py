"""AsyncEngine's engine thread sleeps while it waits and is woken by events, not found by polls:
idle, it blocks on its command queue; waiting for a KV send, it blocks until the connector's
I/O side wakes it; ``flush()`` returns after the outputs of earlier commands were dispatched."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from kvrelay.engine import async_engine
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.kv_connector import KVConnector, TransferEvents
from kvrelay.engine.sampling_params import SamplingParams


class HeldSends(KVConnector):
    """A sender whose deliveries end only when the test says so, from another thread (as
    NIXL's I/O thread would), waking the engine then."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: set[str] = set()
        self.sent: list[str] = []
        self.wake = lambda: None

    def register_kv_cache(self, kv: object, spec: object) -> None:
        pass

    def request_finished(self, seq: object) -> bool:
        with self.lock:
            self.held.add(seq.request_id)  # type: ignore[attr-defined]
        return True

    def take_events(self) -> TransferEvents:
        with self.lock:
            sent, self.sent = self.sent, []
        return TransferEvents(sent, [], [])

    def has_pending(self) -> bool:
        with self.lock:
            return bool(self.held or self.sent)

    def set_waker(self, wake) -> None:  # type: ignore[no-untyped-def]
        self.wake = wake

    def needs_polling(self) -> bool:
        return False

    def deliver(self, request_id: str) -> None:
        with self.lock:
            self.held.discard(request_id)
            self.sent.append(request_id)
        self.wake()


def blocked_on_queue(engine: AsyncEngine) -> bool:
    """The engine thread sits in ``queue.Queue.get`` (a blocking wait), not in a step."""
    assert engine._thread is not None
    frame = sys._current_frames().get(engine._thread.ident)  # type: ignore[arg-type]
    while frame is not None:
        if frame.f_code.co_name == "get" and frame.f_code.co_filename.endswith("queue.py"):
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def no_backstop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a wake-up can end the engine thread's wait during the test."""
    monkeypatch.setattr(async_engine, "IDLE_WAIT_S", 60.0)


def make(model_dir: str, connector: KVConnector | None = None) -> AsyncEngine:
    return AsyncEngine(EngineCore(EngineConfig.from_kwargs(model_dir, num_blocks=64),
                                  connector))


def test_idle_engine_thread_blocks_and_wakes_on_submit(demo_model_dir: str,
                                                       no_backstop: None) -> None:
    async def main() -> None:
        engine = make(demo_model_dir)
        engine.start()
        try:
            await asyncio.sleep(0.2)
            assert blocked_on_queue(engine)
            assert engine.wakeups == 0  # no poll ended a wait while idle
            outs = [o async for o in engine.generate("r", [5, 6, 7], SamplingParams(
                max_tokens=3, ignore_eos=True))]
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 3
            await asyncio.sleep(0.1)
            assert blocked_on_queue(engine)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_kv_send_completion_wakes_the_engine(demo_model_dir: str, no_backstop: None) -> None:
    async def main() -> None:
        conn = HeldSends()
        engine = make(demo_model_dir, conn)
        engine.start()
        try:
            # One token, like a prefill worker's request: its output waits for the delivery.
            gen = engine.generate("p", [5, 6, 7, 8], SamplingParams(max_tokens=1),
                                  kv_transfer_params=object())
            first = asyncio.ensure_future(anext(gen))
            for _ in range(200):
                if conn.held:
                    break
                await asyncio.sleep(0.01)
            assert conn.held == {"p"}
            await asyncio.sleep(0.1)
            assert not first.done()
            waits = engine.wakeups
            await asyncio.sleep(0.1)
            assert blocked_on_queue(engine)
            assert engine.wakeups == waits  # waiting for the send, it does not poll
            conn.deliver("p")  # from the "I/O thread": only this wake-up can end the wait
            out = await asyncio.wait_for(first, 10.0)
            assert out.finished and len(out.new_token_ids) == 1
            await gen.aclose()
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_flush_returns_after_earlier_outputs_are_dispatched(demo_model_dir: str) -> None:
    async def main() -> None:
        engine = make(demo_model_dir)
        engine.start()
        try:
            gen = engine.generate("a", [5, 6, 7], SamplingParams(max_tokens=500,
                                                                 ignore_eos=True))
            await anext(gen)
            stream = engine._streams["a"]
            await engine.abort("a")
            await engine.flush()
            last = None
            while not stream.empty():
                last = stream.get_nowait()
            assert last is not None and last.finished  # the ABORT came before flush returned
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_shutdown_is_prompt_when_idle(demo_model_dir: str, no_backstop: None) -> None:
    async def main() -> None:
        engine = make(demo_model_dir)
        engine.start()
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        engine.shutdown()
        assert engine._thread is not None and not engine._thread.is_alive()
        assert time.monotonic() - t0 < 30  # woken by the stop command, not the backstop

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["generate", "reserve"])
def test_a_request_cancelled_while_its_add_is_queued_never_runs(demo_model_dir: str,
                                                                kind: str) -> None:
    """A prefill cancelled before the engine thread took its add_request was added anyway and
    never aborted: it prefilled later and wrote KV into blocks its receiver had released."""
    async def main() -> None:
        engine = make(demo_model_dir)
        engine.start()
        try:
            total = engine.core.block_manager.num_free_blocks
            gate = threading.Event()
            busy = asyncio.ensure_future(engine.call(gate.wait, 10.0))  # holds the thread
            await asyncio.sleep(0.05)
            if kind == "generate":
                gen = engine.generate("x", [5, 6, 7, 8], SamplingParams(max_tokens=400,
                                                                        ignore_eos=True))
                task = asyncio.ensure_future(anext(gen))
            else:
                task = asyncio.ensure_future(engine.reserve("x", [5, 6, 7, 8]))
            await asyncio.sleep(0.05)  # its command is queued behind the held one
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            await busy
            await engine.flush()
            await asyncio.sleep(0.1)
            await engine.flush()
            assert "x" not in engine.core.seqs
            assert not engine.core.has_unfinished()
            assert engine.core.block_manager.num_free_blocks == total
            assert "x" not in engine._streams
            # the id is free for a later request, which gets no stale output
            outs = [o async for o in engine.generate("x", [5, 6, 7], SamplingParams(
                max_tokens=3, ignore_eos=True))]
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 3
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_spawn_loads_the_core_on_the_thread_that_steps_it(demo_model_dir: str) -> None:
    """One thread does all the core's torch work, loading included: a second thread opening
    OpenMP regions would make libgomp throttle its workers' spin-waits (see spawn)."""
    built_on: list[int] = []
    stepped_on: list[int] = []

    def build() -> EngineCore:
        built_on.append(threading.get_ident())
        return EngineCore(EngineConfig.from_kwargs(demo_model_dir, num_blocks=64))

    async def main() -> None:
        engine = await AsyncEngine.spawn(build)
        try:
            step = engine.core.step

            def spy() -> list:
                stepped_on.append(threading.get_ident())
                return step()

            engine.core.step = spy  # type: ignore[method-assign]
            outs = [o async for o in engine.generate("r", [5, 6, 7], SamplingParams(
                max_tokens=3, ignore_eos=True))]
            assert outs[-1].finished
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert built_on and set(stepped_on) == set(built_on)
    assert built_on[0] != threading.get_ident()


def test_spawn_reports_a_failed_build() -> None:
    def build() -> EngineCore:
        raise ValueError("no such checkpoint")

    async def main() -> None:
        with pytest.raises(ValueError, match="no such checkpoint"):
            await AsyncEngine.spawn(build)

    asyncio.run(main())


def test_outputs_a_slow_reader_let_pile_up_go_out_as_one(demo_model_dir: str) -> None:
    """A consumer that falls behind gets the queued tokens merged into one output (fewer
    messages downstream), the same tokens in the same order, with their logprobs."""
    async def main() -> None:
        engine = make(demo_model_dir)
        engine.start()
        try:
            sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
            fast = [o async for o in engine.generate("fast", [5, 6, 7], sp)]
            slow = []
            async for o in engine.generate("slow", [5, 6, 7], sp):
                slow.append(o)
                await asyncio.sleep(0.05)  # the engine steps on meanwhile
            tokens = [t for o in fast for t in o.new_token_ids]
            assert [t for o in slow for t in o.new_token_ids] == tokens and len(tokens) == 40
            assert len(slow) < len(fast)  # merged: fewer outputs than tokens
            assert all(len(o.logprobs) == len(o.new_token_ids) for o in slow)
            assert slow[-1].finished and not any(o.finished for o in slow[:-1])
        finally:
            engine.shutdown()

    asyncio.run(main())
