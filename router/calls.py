"""What a worker call's ending means, and how to end one: the trailers by which a worker says
that nothing was written, that the KV destination failed, or that it is draining; a
CancelledError that is the dropped channel's rather than the request's; and cancelling a call
without waiting for it."""

from __future__ import annotations

import asyncio

import grpc

from kvrelay.common.failures import FailureKind, failure_of
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.worker_state import WorkerState


def cancel(task: asyncio.Future[object] | None) -> None:
    """Cancel a call we no longer want, and retrieve its outcome (an exception of a call that
    ended on its own would otherwise be logged as never retrieved). Does not wait for it."""
    if task is None:
        return
    task.cancel()
    task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future[object]) -> None:
    if not task.cancelled():
        task.exception()


def nothing_written(e: grpc.aio.AioRpcError) -> bool:
    """True when a Prefill was refused before it wrote any KV (common/failures.py)."""
    return failure_of(e).nothing_written


def dest_failed(e: grpc.aio.AioRpcError) -> bool:
    """True when a Prefill failed because of its KV destination, not its own."""
    return failure_of(e).kind == FailureKind.FAILURE_KV_DESTINATION


def draining(e: grpc.aio.AioRpcError) -> bool:
    """True when the worker refused because it is leaving as planned (suspect nothing)."""
    return failure_of(e).kind == FailureKind.FAILURE_DRAINING


def call_cancelled(registry: WorkerRegistry, w: WorkerState) -> bool:
    """Whether a CancelledError out of a call to ``w`` is the call's, not this request's.

    The registry closes the channel of a worker it drops (missed heartbeats), which cancels the
    calls in flight on it: they raise CancelledError although nobody cancelled the request.
    Left alone, that ends the request's handler without a status, and the client waits until
    its deadline (forever without one). Such a call counts as a lost worker instead.
    """
    task = asyncio.current_task()
    if task is not None and hasattr(task, "cancelling"):  # Python >= 3.11
        return task.cancelling() == 0
    return registry.workers.get(w.worker_id) is not w
