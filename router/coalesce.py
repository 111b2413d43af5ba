"""A request's deltas for a client that reads slower than tokens arrive: several tokens go out as
one message instead of a backlog of one message per token.

The APIs send one message (SSE event, GenerateResponse) per delta, and report how long each took
to go out (``Coalescer.sent``). While the client keeps up, a ``Coalescer`` hands the request's
stream straight through (no task, no step of its own per token). Once a message takes longer than
``SLOW_SEND_S``, the client (or the transport in front of it) is holding it back: from then on,
to the request's end, a task reads the stream ahead, and each message carries every delta ready
by the time the client can take it, merged per choice. (Reading ahead does not stop when the
client catches up: a client behind a flow-control window alternates runs of quick sends with a
long wait, and only a stream read during the wait has its tokens at hand afterwards.) Nothing
ever waits for more tokens: a ready delta goes out at once.

Only what the transports let the router see can coalesce: the HTTP server bounds the unsent
bytes it leaves to the kernel (``http_api.NOTSENT_LOWAT``), but a gRPC client's window is its
own (megabytes by default, taken in before the client reads).

Merging keeps the stream's content: the concatenation of the messages' text, token ids and
logprobs is the same, each choice's finish comes on its last message, and the request's last
delta (``done``: usage, timing, trace) stays the last message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence

from kvrelay.router.outputs import Delta

# A message that took longer than this to go out was held back by the client (its TCP or HTTP/2
# window full) or by a router too loaded to keep up: tokens pile up meanwhile. A send that only
# copies bytes into the transport takes microseconds; one through gRPC's completion queue a few
# hundred (up to ~3 ms on two loaded cores). A slow client holds a send back until it reads
# again, or for a round trip at least.
SLOW_SEND_S = 0.005


def merge(deltas: Sequence[Delta]) -> Delta:
    """Consecutive deltas of one choice, in order, as one: text, token ids and logprobs joined;
    the finish, usage and timing of the last; the prompt's logprobs of the first that has them.
    """
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return Delta(last.request_id, "".join(d.text for d in deltas),
                 [t for d in deltas for t in d.token_ids],
                 [lp for d in deltas for lp in d.logprobs],
                 finished=last.finished, finish_reason=last.finish_reason,
                 stop_reason=last.stop_reason, usage=last.usage, timing=last.timing,
                 trace=last.trace, index=last.index, done=last.done,
                 prompt_logprobs=next((d.prompt_logprobs for d in deltas
                                       if d.prompt_logprobs is not None), None))


def take_ready(ready: list[Delta]) -> Delta:
    """Remove the first of ``ready`` (deltas in stream order) and every later one of its choice,
    and return them merged. Choices are never merged together, and the request's last delta
    (``done``) is left behind while another choice still has a delta ready: it must go last."""
    if len(ready) == 1:
        return ready.pop()
    i = ready[0].index
    mine = [d for d in ready if d.index == i]
    rest = [d for d in ready if d.index != i]
    if rest and mine[-1].done:
        rest.append(mine.pop())
    ready[:] = rest
    return merge(mine)


class _ReadAhead:
    """Reads ``source`` in a task of its own into a list of ready deltas; owns the source from
    then on (closes it when done, failed or cancelled)."""

    def __init__(self, source: AsyncIterator[Delta]):
        self._source = source
        self._ready: list[Delta] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: Exception | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for d in self._source:
                self._ready.append(d)
                self._wake()
                if d.done:
                    break
        except Exception as e:  # delivered after the deltas that came before it
            self._error = e
        finally:
            self._ended = True
            self._wake()
            await self._source.aclose()  # type: ignore[attr-defined]

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> Delta:
        """Every delta ready now, merged (waits for one if none is); at the end
        StopAsyncIteration, or the stream's error once the deltas before it are out."""
        while not self._ready:
            if self._ended:
                err, self._error = self._error, None
                if err is not None:
                    raise err
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return take_ready(self._ready)

    async def close(self) -> None:
        """Stop reading: the source's cleanup (the request's cancellation) runs at once."""
        if not self._task.done():
            self._task.cancel()
        await asyncio.wait([self._task])


class Coalescer:
    """``source``'s deltas for one API stream (``async for``). The sender reports each message's
    send (``sent``); from one held back longer than ``slow_send_s`` on, each message is every
    delta ready by then (``take_ready``). ``aclose`` closes ``source``."""

    def __init__(self, source: AsyncIterator[Delta], slow_send_s: float = SLOW_SEND_S):
        self._source = source
        self._slow_send_s = slow_send_s
        self._ahead: _ReadAhead | None = None

    def __aiter__(self) -> Coalescer:
        return self

    def __anext__(self) -> Awaitable[Delta]:
        if self._ahead is None:  # the client keeps up: the source's own step, nothing added
            return self._source.__anext__()
        return self._ahead.next()

    @property
    def reading_ahead(self) -> bool:
        return self._ahead is not None

    def sent(self, delta: Delta, took_s: float) -> None:
        """``delta`` took ``took_s`` to go out: over ``slow_send_s``, read ahead from now on."""
        if took_s > self._slow_send_s and self._ahead is None and not delta.done:
            self._ahead = _ReadAhead(self._source)

    async def aclose(self) -> None:
        if self._ahead is not None:
            await self._ahead.close()
        else:
            await self._source.aclose()  # type: ignore[attr-defined]
