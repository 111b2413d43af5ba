"""Drive an ``EngineCore`` on its own thread and talk to it from asyncio.

Every engine mutation runs on the engine thread (commands go through a queue), so the core
stays single-threaded. The thread steps while there is work and otherwise blocks on the command
queue, which is also its wake-up: a command, or the KV connector's I/O thread when a transfer
ends (``KVConnector.set_waker``), wakes it at once. It polls, every ``poll_interval`` seconds,
only while the connector waits for events that nothing signals (``needs_polling``: incoming KV
notifications, deadlines). No spinning, ≈ 0 CPU at rest. Outputs reach the asyncio loop with
``call_soon_threadsafe``, and ``flush()`` lets the loop wait for the outputs of the commands it
issued, without polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

from kvrelay.engine.engine_core import (
    EngineCore,
    EngineStats,
    RequestIdInUse,
    RequestOutput,
    Reservation,
)
from kvrelay.engine.outputs import ErrorKind
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import FinishReason
from kvrelay.engine.tp_shard import TensorParallelError

logger = logging.getLogger(__name__)

T = TypeVar("T")


IDLE_WAIT_S = 0.5  # longest block on the command queue (a backstop; wake-ups come sooner)
# Waiting for KV with nothing to step: the sender's write completes, and its notification is
# seen, only when this side progresses UCX (at 2 ms: 1.4 + 1.7 ms of a 32-token hand-off).
KV_POLL_INTERVAL_S = 0.0005  # ~6 % of a core while it lasts


class AsyncEngine:
    def __init__(self, core: EngineCore, *, poll_interval: float = KV_POLL_INTERVAL_S,
                 on_step: Callable[[float, int], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.core = core
        # Called (engine thread) when a step leaves the engine unusable (a TP rank died): the
        # owner ends the process so that the requests migrate, as after any crash.
        self.on_fatal = on_fatal
        self.fatal: BaseException | None = None
        self.poll_interval = poll_interval
        self.on_step = on_step  # (seconds, tokens) after each step that ran the model
        self._cmds: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._flushes: list[asyncio.Future[None]] = []  # engine thread's: resolved after a step
        self.stats: EngineStats = core.stats()
        self.wakeups = 0  # waits ended (command, wake-up, poll, backstop): does it sleep or poll
        self.pinned: dict[int, int] = {}  # engine thread ids -> CPU (Platform.bind_thread)
        self._step_started: float | None = None  # monotonic start of the step running now

    def busy_since(self) -> float | None:
        """When the step running now began (monotonic; None between steps): any thread, for
        a watchdog (``kvrelay.worker.watchdog``)."""
        return self._step_started

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    async def spawn(cls, build: Callable[[], EngineCore], **kwargs: Any) -> AsyncEngine:
        """Build the core on the thread that will drive it, then start driving it.

        Every torch op the engine runs should start its parallel regions from that one thread:
        libgomp keeps a thread pool per thread that opens parallel regions, and once two pools
        exist (the loading thread's and the stepping thread's) there are more OpenMP threads
        than cores, so it throttles its workers' spin-wait to ~1000 iterations and every
        parallel region of a step pays futex wake-ups instead. Measured on the ~150M model:
        a batch-1 decode step 16.3 ms on the loading thread, 20.3 ms on a second thread, the
        same 16 ms on a second thread that also loaded the model."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[EngineCore] = loop.create_future()
        holder: list[AsyncEngine] = []

        def boot() -> None:
            try:
                core = build()
            except BaseException as e:  # re-raised on the loop
                loop.call_soon_threadsafe(_set_exception, ready, e)
                return
            engine = cls(core, **kwargs)
            engine._bind(loop)
            engine._thread = threading.current_thread()
            holder.append(engine)
            loop.call_soon_threadsafe(_set_result, ready, core)
            engine._run()

        threading.Thread(target=boot, name="engine", daemon=True).start()
        await ready
        return holder[0]

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._bind(loop or asyncio.get_running_loop())
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Outputs go to ``loop``; the connector's I/O thread wakes the engine thread."""
        self._loop = loop
        if self.core.connector is not None:
            self.core.connector.set_waker(self.wake)

    def wake(self) -> None:
        """Wake the engine thread (thread-safe): a transfer it may be waiting for has ended."""
        self._cmds.put(_nothing)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self.core.connector is not None:
            self.core.connector.close()
        self.core.close()

    # -- API -----------------------------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the engine thread; its exception is raised here."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._cmds.put(run)
        return await fut

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams, *, kv_transfer_params: object | None = None,
                       arrival_time: float | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Prefill here and stream outputs until the request finishes."""
        await self.compile_grammar(sampling)
        stream = self._open(request_id)
        await self._admit(request_id, self.core.add_request, request_id, prompt_token_ids,
                          sampling, kv_transfer_params=kv_transfer_params,
                          arrival_time=arrival_time, cache_salt=cache_salt)
        async for out in self._drain(request_id, stream):
            yield out

    async def reserve(self, request_id: str, prompt_token_ids: list[int], *,
                      kv_transfer_params: object | None = None,
                      cache_salt: str | None = None) -> Reservation:
        self._open(request_id)
        return await self._admit(request_id, self.core.reserve, request_id, prompt_token_ids,
                                 kv_transfer_params=kv_transfer_params, cache_salt=cache_salt)

    async def decode(self, request_id: str, first_token_id: int,
                     sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream a reserved request's tokens after ``first_token_id``."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"no reservation for request {request_id!r}")
        await self.compile_grammar(sampling)
        await self.call(self.core.start_decode, request_id, first_token_id, sampling)
        async for out in self._drain(request_id, stream):
            yield out

    async def compile_grammar(self, sampling: SamplingParams) -> None:
        """Compile a structured-output request's grammar on a thread (the engine thread then
        finds it cached): a compile, up to seconds for a large schema, must not stall the
        steps of every other request. ValueError if it does not compile."""
        so = sampling.structured
        if so is None:
            return
        core = self.core
        if core._grammar is None or not core._grammar.is_cached(so):
            await asyncio.to_thread(lambda: core.grammar.check(so))
        else:
            core._grammar.check(so)  # a cached failure raises its reason again

    async def decode_forks(self, request_id: str, first_token_id: int, sampling: SamplingParams,
                           forks: list[tuple[str, int]]) -> AsyncIterator[RequestOutput]:
        """``decode`` of an ``n > 1`` request: the reservation plus its forks (``(child id,
        first token)`` each, see ``EngineCore.start_decode``), their outputs interleaved on one
        stream (each carries its request id) until every one has finished. Leaving early
        aborts those still running."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"no reservation for request {request_id!r}")
        ids = [request_id] + [cid for cid, _ in forks]
        for cid in ids[1:]:
            if cid in self._streams:
                raise RequestIdInUse(f"request id {cid!r} is already in use")
        for cid in ids[1:]:
            self._streams[cid] = stream
        running = set(ids)
        try:
            await self.call(self.core.start_decode, request_id, first_token_id, sampling, forks)
            while running:
                out = await stream.get()
                if out.finished:
                    running.discard(out.request_id)
                yield out
        finally:
            for rid in ids:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            for rid in running:  # the caller went away: give the blocks back
                self._cmds.put(lambda rid=rid: self.core.abort(rid))

    async def abort(self, request_id: str) -> bool:
        """Abort a request; a consumer still reading its stream gets a final ABORT output."""
        return await self.call(self.core.abort, request_id)

    async def forget(self, request_id: str) -> None:
        """Drop the output stream of a request nobody will read (a reservation given up before
        its Decode): after the request's last output was dispatched (the ``flush``), so that it
        cannot land in the stream of a later request of the same id."""
        await self.flush()
        self._streams.pop(request_id, None)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    async def flush(self) -> None:
        """Return once every output the engine made for commands issued before this call has
        been dispatched to its stream (e.g. the ABORT output of an ``abort``)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._cmds.put(lambda: self._flushes.append(fut))
        await fut

    # -- internals -----------------------------------------------------------------------------
    async def _admit(self, request_id: str, fn: Callable[..., T], *args: Any,
                     **kwargs: Any) -> T:
        """Run ``fn`` (which adds the request to the core) on the engine thread. A caller
        cancelled while the command waits in the queue (or runs) must not leave the request in
        the engine: nobody would read or abort it, and a prefill would later write its KV into
        blocks its receiver has given up. Not yet run: it never adds it; already added: an
        abort queued behind it takes it out. An id the core refused is left alone (it is
        another request's)."""
        cancelled = threading.Event()
        added = threading.Event()

        def admit() -> T:
            if cancelled.is_set():
                raise asyncio.CancelledError
            result = fn(*args, **kwargs)
            added.set()
            return result

        try:
            return await self.call(admit)
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):
                cancelled.set()
                # Commands run in order: this one runs after ``admit`` has or has not added it.
                self._cmds.put(lambda: added.is_set() and self.core.abort(request_id, emit=False))
            raise

    def _open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        if request_id in self._streams:
            raise RequestIdInUse(f"request id {request_id!r} is already in use")
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    async def _drain(self, request_id: str,
                     stream: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            held: RequestOutput | None = None
            while True:
                out, held = (held, None) if held is not None else (await stream.get(), None)
                # Outputs that queued up while the consumer was busy (a slow client, a loaded
                # router) go out as one: every message downstream costs per message, not per
                # token, so a backlog shrinks instead of growing. A ``kv_arrived`` output (no
                # tokens, a signal of its own) is never merged.
                while not out.finished and not out.kv_arrived and not stream.empty():
                    nxt = stream.get_nowait()
                    if nxt.kv_arrived:
                        held = nxt
                        break
                    out = _merge(out, nxt)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the caller went away: give the blocks back
                self._cmds.put(lambda: self.core.abort(request_id))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _run(self) -> None:
        core = self.core
        # On its GPU, or with its OpenMP threads pinned one per CPU (Platform.bind_thread).
        self.pinned = core.runner.platform.bind_thread(core.config.model)
        conn = core.connector
        while not self._stop.is_set():
            if core.has_schedulable():
                timeout: float | None = 0.0
            elif core.has_unfinished() and conn is not None and conn.needs_polling():
                timeout = self.poll_interval  # incoming KV: nothing signals it, so poll
            else:
                timeout = IDLE_WAIT_S  # idle, or waiting for a command or a wake-up
            try:
                cmd = self._cmds.get(timeout=timeout) if timeout else self._cmds.get_nowait()
                cmd()
                while True:
                    self._cmds.get_nowait()()
            except queue.Empty:
                pass
            if timeout:
                self.wakeups += 1
            if self._stop.is_set():
                break
            if core.has_unfinished():
                self._step()
            if self._flushes and self._loop is not None:
                # After this step's dispatch (callbacks run in order): its outputs came first.
                flushes, self._flushes = self._flushes, []
                self._loop.call_soon_threadsafe(_resolve_all, flushes)
        if self._flushes and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                self._loop.call_soon_threadsafe(_resolve_all, self._flushes)

    def _step(self) -> None:
        core = self.core
        t0 = time.perf_counter()
        if self.fatal is not None:
            return
        self._step_started = time.monotonic()
        try:
            outputs = core.step()
        except TensorParallelError as e:
            if self.on_fatal is None:
                logger.exception("engine step failed; failing every request in flight")
                outputs = self._fail_all("engine step failed")
            else:
                logger.critical("the engine is unusable: %s", e)
                self.fatal = e
                self.on_fatal(e)
                return
        except Exception:
            logger.exception("engine step failed; failing every request in flight")
            outputs = self._fail_all("engine step failed")
        finally:
            self._step_started = None
        self.stats = core.stats()
        if self.on_step is not None and outputs:
            self.on_step(time.perf_counter() - t0, sum(len(o.new_token_ids) for o in outputs))
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        outs = []
        for rid in list(self.core.seqs):
            self.core.abort(rid)
            outs.append(RequestOutput(rid, [], True, FinishReason.ERROR, error=reason,
                                      error_kind=ErrorKind.ENGINE))
        return outs


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``a`` then ``b`` as one output (``b`` is later: its state wins)."""
    return replace(b, new_token_ids=a.new_token_ids + b.new_token_ids,
                   logprobs=a.logprobs + b.logprobs,
                   scheduled_at=a.scheduled_at if a.scheduled_at is not None else b.scheduled_at,
                   fork_firsts=a.fork_firsts or b.fork_firsts,
                   prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None
                   else b.prompt_logprobs)


def _nothing() -> None:
    return None


def _resolve_all(futs: list[asyncio.Future[None]]) -> None:
    for fut in futs:
        _set_result(fut, None)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
