"""The engine's KV events in vLLM's wire format over ZMQ, so external routers index this worker.

llm-d's precise prefix-cache scorer and Dynamo's KV router build their index of which worker
holds which prefix from vLLM's KV events; a kvrelay worker started with
``--kv-events-endpoint`` publishes the same stream, so either can route to it as to vLLM.

The wire contract (vLLM's ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

- one ZMQ multipart message per batch: ``(topic, sequence, payload)``; ``sequence`` is 8
  bytes, big-endian, counting batches from 0 with no gap; ``topic`` is ``--kv-events-topic``
  (llm-d's pod discovery expects ``kv@<pod>@<model>``);
- ``payload`` is msgspec's msgpack of an ``EventBatch``, an array ``[ts, events,
  data_parallel_rank]``;
- each event is a struct tagged by its class name (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``): by default a map with the tag under ``"type"``, as vLLM emits since
  vllm#42892; ``encoding="array"`` emits the positional arrays ``[tag, field, ...]`` of the vLLM
  releases before it, for consumers that predate the change;
- block hashes are unsigned 64-bit integers (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK
  _HASHES=1``; kvrelay's chain hashes are 64-bit already); a chain's root parent is nil;
- ``medium`` names the tier with vLLM's own names (``MEDIUM``);
- a ROUTER replay socket (``--kv-events-replay-endpoint``) answers a request ``(b"",
  start_seq)`` (8 bytes, big-endian) with each buffered batch from ``start_seq`` on, as
  ``(b"", topic, seq, payload)``, then ``(b"", b"", -1, b"")``: a consumer that saw a gap in
  the sequence numbers fetches what it missed.

The engine thread (and the tiers' IO) call the sink methods, which only append to a bounded
buffer; a thread of this publisher encodes and sends a batch a few milliseconds after the first
event of an idle spell. Past the bound, events are dropped and counted, and the next batch ends
with ``AllBlocksCleared``: consumers then forget this worker's blocks rather than keep ones it no
longer holds (missed prefix hits, never phantom ones). The stream starts with
``AllBlocksCleared`` (consumers reset what they knew of a previous incarnation) and ends with
one on ``close()`` (the worker's KV goes with it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from kvrelay.engine.prefix_hash import ROOT_HASH
from kvrelay.engine.tiers.media import DEVICE, DISK, HOST

logger = logging.getLogger(__name__)

# kvrelay's tiers under the names vLLM emits (vllm.distributed.kv_events.MEDIUM_*: the device
# pool is "GPU" even on a CPU worker, where it plays the role vLLM's GPU pool plays). llm-d
# lowercases them and weights each by its kvCacheBackendConfigs entry ("gpu", "cpu", ...);
# Dynamo reads GPU as its device tier, CPU as host-pinned and STORAGE as disk.
MEDIUM = {DEVICE: "GPU", HOST: "CPU", DISK: "STORAGE"}
ENCODINGS = ("map", "array")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``KVCacheEvent``: tagged by class name. The optional fields vLLM added later
    (``extra_keys``, ``group_idx``, ...) are not emitted; decoders default them."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6-any, ipc and inproc endpoints are bound, others connected
    to (a consumer that binds, as llm-d's global-socket mode does)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    """A ``KVEventSink`` (engine/kv_events.py) that publishes over ZMQ; ``start()``, then
    ``close()``. Sockets are bound (or connected) in the constructor, so a taken port fails
    the worker's start."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None, *,
                 encoding: str = "map", max_buffered_events: int = 100_000,
                 replay_batches: int = 10_000, batch_interval_s: float = 0.005,
                 hwm: int = 100_000, linger_s: float = 0.5):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        self._array = encoding == "array"
        self._topic = topic.encode()
        self._max = max_buffered_events
        self._interval = batch_interval_s
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._unreported_drops = 0
        self.dropped_events = 0  # events lost to a full buffer (each answered by a reset)
        self.sent_batches = 0  # also the next batch's sequence number
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._encoder = msgspec.msgpack.Encoder()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, int(linger_s * 1000))
            self.endpoint = self._attach(self._pub, endpoint, _binds(endpoint))
            self.replay_endpoint = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._attach(self._replay, replay_endpoint, True)
        except BaseException:
            self._release()
            raise

    @staticmethod
    def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the port a ":0" bound

    # -- the engine's side (KVEventSink) ------------------------------------------------------
    def stored(self, medium: str, block_hashes: Sequence[int], parent_hash: int | None,
               token_ids: Sequence[int], block_size: int) -> None:
        self._put(("s", medium, tuple(block_hashes), parent_hash, tuple(token_ids), block_size))

    def removed(self, medium: str, block_hashes: Sequence[int]) -> None:
        self._put(("r", medium, tuple(block_hashes)))

    def cleared(self) -> None:
        self._put(("c",))

    def _put(self, event: tuple) -> None:
        with self._lock:
            if self._stopping:  # closed (or closing): nothing will send it
                return
            if len(self._pending) >= self._max:
                self.dropped_events += 1
                self._unreported_drops += 1
                return
            self._pending.append(event)
            if len(self._pending) == 1:  # the first since the last batch: wake the thread
                self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
            os.write(self._wake_w, b"x")

    # -- the publisher thread -----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            self._send([AllBlocksCleared()])  # whatever consumers knew of this worker is gone
            while not self._stopping:
                ready = dict(poller.poll())
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    if not self._stopping:
                        time.sleep(self._interval)  # let the rest of the step's events in
                    self._flush()
            self._flush()
            self._send([AllBlocksCleared()])  # this worker's KV goes with it
        except Exception:
            logger.exception("the KV event publisher stopped; consumers no longer hear this "
                             "worker's KV events")

    def _flush(self) -> None:
        with self._lock:
            raw, self._pending = self._pending, []
            drops, self._unreported_drops = self._unreported_drops, 0
        events = self._convert(raw)
        if drops:
            # Every event before the drops is in this batch: the reset comes after them.
            logger.warning("KV event buffer full: %d events dropped; consumers reset this "
                           "worker's index (dropped in all: %d)", drops, self.dropped_events)
            events.append(AllBlocksCleared())
        if events:
            self._send(events)

    def _convert(self, raw: list[tuple]) -> list[_Event]:
        """The buffered events as vLLM's; consecutive ones that continue each other merge (a
        chain of stored blocks, removals from one tier), as vLLM reports a step's blocks."""
        out: list[_Event] = []
        for ev in raw:
            kind = ev[0]
            last = out[-1] if out else None
            if kind == "s":
                _, medium, hashes, parent, tokens, block_size = ev
                medium = MEDIUM.get(medium, medium.upper())
                parent = None if parent == ROOT_HASH else parent
                if (isinstance(last, BlockStored) and last.medium == medium
                        and last.block_size == block_size and parent is not None
                        and last.block_hashes[-1] == parent):
                    last.block_hashes.extend(hashes)
                    last.token_ids.extend(tokens)
                else:
                    out.append(BlockStored(list(hashes), parent, list(tokens), block_size,
                                           None, medium, None))
            elif kind == "r":
                _, medium, hashes = ev
                medium = MEDIUM.get(medium, medium.upper())
                if isinstance(last, BlockRemoved) and last.medium == medium:
                    last.block_hashes.extend(hashes)
                else:
                    out.append(BlockRemoved(list(hashes), medium))
            else:
                out.append(AllBlocksCleared())
        return out

    def _send(self, events: list[_Event]) -> None:
        wire: list[Any] = events
        if self._array:
            wire = [[type(e).__name__, *msgspec.structs.astuple(e)] for e in events]
        payload = self._encoder.encode(EventBatch(time.time(), wire, 0))
        seq = self.sent_batches
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self.sent_batches = seq + 1
        if self._replay is not None:
            self._replay_buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            logger.warning("malformed KV event replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._replay_buffer:
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # -- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Send what is buffered and the closing ``AllBlocksCleared``, stop the thread, close
        the sockets (waiting up to ``linger_s`` for unsent messages). Idempotent."""
        if self._ctx.closed:
            return
        with self._lock:  # a sink call in progress finishes (its wake-up written) first
            self._stopping = True
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout=10.0)
            if self._thread.is_alive():
                logger.error("the KV event publisher thread did not stop; its sockets stay open")
                return
        self._release()

    def _release(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
