"""CUDA ordering between the engine's kernels and the KV sender thread.

A layer's K/V is written by kernels queued on the worker's device's current stream; the sender
must not post the NIXL write before they finish. The event is recorded on that stream (not the
process's current device, GPU 0 on a worker running on ``cuda:1``) and is a blocking-sync event,
so the sender thread sleeps in ``synchronize()`` instead of spinning a core."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def record_ready_event(device: torch.device,
                       event_factory: Callable[..., Any] | None = None,
                       stream_of: Callable[[torch.device], Any] | None = None) -> Any:
    """An event recorded after everything queued so far on ``device``'s current stream.
    ``event_factory``/``stream_of`` default to torch's (replaceable for a CPU unit test)."""
    assert device.type == "cuda", device
    make = event_factory or torch.cuda.Event
    stream = (stream_of or torch.cuda.current_stream)(device)
    event = make(blocking=True)
    event.record(stream)
    return event


def bind_thread_to(device: torch.device | None) -> None:
    """Make ``device`` current in the calling thread (each thread starts on GPU 0), before it
    creates a CUDA context, events or NIXL peers."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.synchronize(device)  # creates the primary context if it is not there yet
