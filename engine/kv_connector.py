"""The hooks through which KV leaves or enters an engine's cache.

The engine calls a connector at fixed points and never learns how bytes move. Methods by side:

Scheduler side (bookkeeping only, no I/O):
  - ``request_waiting_for_kv(seq)``: ``seq`` holds reserved blocks that a peer will fill.
  - ``request_finished(seq) -> bool``: ``seq`` finished or was aborted; return True to keep its
    blocks allocated until a later ``take_events().sent`` names it (they are still being read).
  - ``take_events() -> TransferEvents``: transfers that completed or failed since the last call.
  - ``has_pending() -> bool``: whether events may still come.
  - ``set_waker(wake)`` / ``needs_polling() -> bool``: an engine loop that can sleep hands over
    ``wake`` (thread-safe, cheap); the connector calls it when events are ready, and
    ``needs_polling`` says whether some events can only be found by polling ``take_events``
    (the default: all of them, while any is pending).

Worker side (moves bytes, called by the model runner around the forward pass):
  - ``register_kv_cache(kv, spec, ranks)``: once, with the engine's KV tensor (under tensor
    parallelism rank 0's, ``ranks`` naming the others and which heads each holds).
  - ``start_step(scheduled)``: before the forward; ``scheduled`` says which tokens each sequence
    computes this step (counters not yet advanced).
  - ``save_layer(layer)``: right after ``layer``'s new K/V were written to the cache, while later
    layers still compute: the place to start streaming that layer.
  - ``end_step()``: after the forward.
  - ``wants_layer_hooks(scheduled) -> bool``: whether that step needs ``save_layer`` (a decode
    step replayed as a CUDA graph calls none; it runs eagerly when this says True).

Lifecycle: ``close()`` releases the transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvrelay.engine.kv_cache import KVCacheSpec
    from kvrelay.engine.sequence import Sequence


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step: compute ``num_new_tokens`` tokens from
    ``seq.num_computed_tokens`` on (the counter is advanced after the step)."""

    seq: Sequence
    num_new_tokens: int


@dataclass(frozen=True)
class RankKV:
    """Under tensor parallelism or KV head groups: the KV transport's ranks (one per TP rank, or
    per KV head group of each) and the model's KV heads each holds (``[start, stop)``, in
    transport-rank order), of which this process holds ``slots`` (``kv``, then ``others``).
    Under tensor parallelism ``services`` reaches ranks 1..N-1, which hold the rest in their own
    processes and register them with their own agents (``kv_transfer/rank_agents.py``)."""

    others: list[torch.Tensor]
    head_ranges: tuple[tuple[int, int], ...]
    model_kv_heads: int
    slots: tuple[int, ...] = ()  # (): all of them
    services: Any = None  # tensor_parallel.RankServices

    @classmethod
    def from_views(cls, views: Seq[tuple[torch.Tensor, tuple[int, int]]],
                   model_kv_heads: int) -> RankKV:
        """From every rank's tensor and head range, rank 0's first (``kv_cache.group_views``)."""
        return cls([t for t, _ in views[1:]], tuple(r for _, r in views), model_kv_heads)


class TransferEvents(NamedTuple):
    sent: list[str]  # request ids whose blocks the connector no longer reads
    received: list[str]  # request ids whose KV has fully arrived
    failed: list[tuple[str, str]]  # (request id, reason): the transfer will never complete


class KVConnector(ABC):
    # -- lifecycle / worker side -------------------------------------------------------------
    @abstractmethod
    def register_kv_cache(self, kv: torch.Tensor, spec: KVCacheSpec,
                          ranks: RankKV | None = None) -> None: ...

    def start_step(self, scheduled: Seq[ScheduledSeq]) -> None:  # noqa: B027
        """Default: nothing to send."""

    def save_layer(self, layer: int) -> None:  # noqa: B027
        """Default: nothing to send."""

    def wants_layer_hooks(self, scheduled: Seq[ScheduledSeq]) -> bool:
        """Whether a step of ``scheduled`` needs ``save_layer`` called from inside the forward
        (a step replayed as a CUDA graph runs no Python between layers, so it runs eagerly
        then). Default: no per-layer work."""
        return False

    def end_step(self) -> None:  # noqa: B027
        """Default: nothing to send."""

    def close(self) -> None:  # noqa: B027
        """Default: nothing to release."""

    # -- scheduler side -----------------------------------------------------------------------
    def request_waiting_for_kv(self, seq: Sequence) -> None:  # noqa: B027
        """Default: receives nothing."""

    @abstractmethod
    def request_finished(self, seq: Sequence) -> bool: ...

    @abstractmethod
    def take_events(self) -> TransferEvents: ...

    def counters(self) -> dict[str, int]:
        """Event counts to export as metrics (``kvrelay:kv_transfer_events{event}``)."""
        return {}

    @abstractmethod
    def has_pending(self) -> bool: ...

    def set_waker(self, wake: Callable[[], None]) -> None:  # noqa: B027
        """Default: never wakes anyone; ``needs_polling`` covers every pending event."""

    def needs_polling(self) -> bool:
        """Whether a pending event may come without a call to the waker (so poll for it)."""
        return self.has_pending()
