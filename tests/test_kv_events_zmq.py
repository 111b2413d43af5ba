"""The worker's KV event stream in vLLM's wire format (worker/kv_events_zmq.py): a ZMQ SUB socket
receives it and msgspec decodes it with vLLM's published schema, declared below field by field
from ``vllm/distributed/kv_events.py`` (the map-encoded events vLLM emits since vllm#42892, and
the positional arrays before it); sequence numbers count batches without a gap; tiers carry
vLLM's medium names; a full buffer drops and counts events and resets consumers; the ROUTER
replays buffered batches; close() leaves no thread or socket behind. Loopback only."""

from __future__ import annotations

import random
import threading
from typing import Any

import msgspec
import pytest
import zmq

from kvrelay.engine.prefix_hash import ROOT_HASH, block_hashes
from kvrelay.engine.tiers.media import DEVICE, DISK, HOST
from kvrelay.worker.kv_events_zmq import MEDIUM, ZmqKVEventPublisher

LOOPBACK = "tcp://127.0.0.1"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
WAIT_MS = 10_000  # the longest a test waits for one message (a bound, never a timing)


# -- vLLM's published schema (vllm 0.32, vllm/distributed/kv_events.py) --------------------------
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The positional form of the vLLM releases before vllm#42892 (what consumers that predate it
# decode): the same tags, array_like.
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(EventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)
DECODE_LEGACY = msgspec.msgpack.Decoder(LegacyKVEventBatch)


# -- a consumer, as llm-d's and Dynamo's subscribers are ---------------------------------------
class Subscriber:
    """A SUB socket bound on loopback (the publisher connects to it, llm-d's global-socket
    mode) or connected to a publisher's bound endpoint."""

    def __init__(self, ctx: zmq.Context, topic: str = "", connect: str | None = None,
                 decoder: msgspec.msgpack.Decoder = DECODE):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        if connect is None:
            port = self.sock.bind_to_random_port(LOOPBACK)
            self.endpoint = f"{LOOPBACK}:{port}"
        else:
            self.sock.connect(connect)
            self.endpoint = connect
        self.decoder = decoder
        self.last_seq: int | None = None

    def recv(self, timeout_ms: int = WAIT_MS) -> tuple[bytes, int, Any] | None:
        if not self.sock.poll(timeout_ms):
            return None
        topic, seq, payload = self.sock.recv_multipart()
        assert len(seq) == 8
        n = int.from_bytes(seq, "big")
        if self.last_seq is not None:
            assert n == self.last_seq + 1, f"sequence gap: {self.last_seq} then {n}"
        self.last_seq = n
        return topic, n, self.decoder.decode(payload)

    def sync(self, pub: ZmqKVEventPublisher) -> None:
        """Wait until the subscription reached the publisher (ZMQ's slow joiner: a PUB drops
        what it sends before), probing with resets; drain what the probes produced."""
        for _ in range(100):
            pub.cleared()
            if self.recv(100) is not None:
                while self.recv(200) is not None:
                    pass
                return
        raise AssertionError("the subscription never reached the publisher")

    def events_until(self, done: Any) -> list[Any]:
        """Events of every batch received until ``done(events so far)`` holds."""
        got: list[Any] = []
        while not done(got):
            msg = self.recv()
            assert msg is not None, f"stream ended early; got {got}"
            got += msg[2].events
        return got


def per_block(events: list[Any]) -> list[tuple]:
    """Events as one tuple per block, whatever the batching merged."""
    out: list[tuple] = []
    for e in events:
        if isinstance(e, (BlockStored, LegacyBlockStored)):
            parent = e.parent_block_hash
            toks = e.token_ids
            for i, h in enumerate(e.block_hashes):
                out.append(("stored", e.medium, h, parent,
                            tuple(toks[i * e.block_size:(i + 1) * e.block_size])))
                parent = h
        elif isinstance(e, (BlockRemoved, LegacyBlockRemoved)):
            out += [("removed", e.medium, h) for h in e.block_hashes]
        else:
            out.append(("cleared",))
    return out


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[bytes, int, Any]]:
    """Every batch the replay socket answers from ``start`` on (a DEALER, as vLLM's example
    consumer)."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    try:
        d.connect(endpoint)
        d.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            assert d.poll(WAIT_MS), "no replay answer"
            empty, topic, seq, payload = d.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return got
            got.append((topic, int.from_bytes(seq, "big"), DECODE.decode(payload)))
    finally:
        d.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def publishers():
    made: list[ZmqKVEventPublisher] = []

    def make(*args: Any, **kw: Any) -> ZmqKVEventPublisher:
        p = ZmqKVEventPublisher(*args, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def chain(seed: int, n_blocks: int, bs: int = 4) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 4000) for _ in range(n_blocks * bs)]  # the demo vocabulary
    return tokens, block_hashes(tokens, bs)


# -- tests ----------------------------------------------------------------------------------------
def test_stream_decodes_with_vllms_schema(ctx, publishers) -> None:
    """Stored and removed blocks of every tier reach a SUB socket, in order, decoded by vLLM's
    msgspec structs: uint64 hashes, a nil parent at a chain's root, the tokens of each block,
    vLLM's medium names, the topic, data-parallel rank 0."""
    sub = Subscriber(ctx, topic="kv@")
    pub = publishers(sub.endpoint, topic="kv@worker-1@demo")
    pub.start()
    sub.sync(pub)
    tokens, hashes = chain(1, 3)
    big = [2**64 - 1]  # the top of the range still encodes as an unsigned integer
    for i, h in enumerate(hashes):
        pub.stored(DEVICE, [h], hashes[i - 1] if i else ROOT_HASH, tokens[i * 4:(i + 1) * 4], 4)
    pub.stored(HOST, hashes[:1], None, tokens[:4], 4)
    pub.stored(DISK, big, hashes[0], tokens[4:8], 4)
    pub.removed(DEVICE, hashes[1:])
    pub.removed(DISK, big)
    want = [("stored", "GPU", hashes[0], None, tuple(tokens[0:4])),
            ("stored", "GPU", hashes[1], hashes[0], tuple(tokens[4:8])),
            ("stored", "GPU", hashes[2], hashes[1], tuple(tokens[8:12])),
            ("stored", "CPU", hashes[0], None, tuple(tokens[0:4])),
            ("stored", "STORAGE", big[0], hashes[0], tuple(tokens[4:8])),
            ("removed", "GPU", hashes[1]), ("removed", "GPU", hashes[2]),
            ("removed", "STORAGE", big[0])]
    topics, batches = set(), []
    got: list[tuple] = []
    while len(got) < len(want):
        msg = sub.recv()
        assert msg is not None, f"stream ended early: {got}"
        topic, _, batch = msg
        topics.add(topic)
        batches.append(batch)
        got += [e for e in per_block(batch.events) if e != ("cleared",)]
    assert got == want
    assert topics == {b"kv@worker-1@demo"}
    assert all(b.data_parallel_rank == 0 and b.ts > 0 for b in batches)
    assert MEDIUM == {DEVICE: "GPU", HOST: "CPU", DISK: "STORAGE"}


def test_batches_merge_chains_and_start_with_a_reset(ctx, publishers) -> None:
    """Events buffered together go out as one batch, after the opening AllBlocksCleared (seq
    0); a chain of stored blocks in one tier is one BlockStored, as vLLM reports a step's."""
    sub = Subscriber(ctx)
    pub = publishers(sub.endpoint, replay_endpoint=f"{LOOPBACK}:0")
    assert pub.endpoint == sub.endpoint  # a host endpoint is connected to (vLLM's rule)
    tokens, hashes = chain(2, 4)
    for i, h in enumerate(hashes):
        pub.stored(DEVICE, [h], hashes[i - 1] if i else ROOT_HASH, tokens[i * 4:(i + 1) * 4], 4)
    pub.stored(DEVICE, [7], 99, [1, 2, 3, 4], 4)  # continues no chain: an event of its own
    pub.removed(HOST, [1])
    pub.removed(HOST, [2])
    pub.removed(DEVICE, [3])
    pub.start()
    got = replay_until(ctx, pub.replay_endpoint, 0, batches=2)
    assert [seq for _, seq, _ in got] == [0, 1]
    assert got[0][2].events == [AllBlocksCleared()]
    assert got[1][2].events == [
        BlockStored(hashes, None, tokens, 4, None, "GPU", None),
        BlockStored([7], 99, [1, 2, 3, 4], 4, None, "GPU", None),
        BlockRemoved([1, 2], "CPU"), BlockRemoved([3], "GPU")]


def test_a_full_buffer_drops_counts_and_resets_consumers(ctx, publishers) -> None:
    """Past the bound the sink drops (cheaply, on the engine's thread) and counts; the batch
    that follows ends with AllBlocksCleared, after every event kept, so a consumer never keeps
    a block the worker may have removed among the dropped events."""
    pub = publishers(Subscriber(ctx).endpoint, replay_endpoint=f"{LOOPBACK}:0",
                     max_buffered_events=3)
    for h in range(1, 6):
        pub.stored(DEVICE, [h], None, [h] * 4, 4)
    assert pub.dropped_events == 2
    pub.start()
    got = replay_until(ctx, pub.replay_endpoint, 0, batches=2)
    assert [seq for _, seq, _ in got] == [0, 1]
    assert per_block(got[1][2].events) == [
        ("stored", "GPU", 1, None, (1,) * 4), ("stored", "GPU", 2, None, (2,) * 4),
        ("stored", "GPU", 3, None, (3,) * 4), ("cleared",)]
    # Space again: events flow, and no further reset.
    pub.removed(DEVICE, [1])
    assert per_block(replay_until(ctx, pub.replay_endpoint, 2)[0][2].events) == [
        ("removed", "GPU", 1)]
    assert pub.dropped_events == 2


def replay_until(ctx: zmq.Context, endpoint: str, start: int,
                 batches: int = 1) -> list[tuple[bytes, int, Any]]:
    """``replay`` once the publisher's thread has sent ``batches`` batches from ``start`` on (a
    bounded wait: it sends them after ``start()`` returns)."""
    got: list[tuple[bytes, int, Any]] = []
    for _ in range(200):
        got = replay(ctx, endpoint, start)
        if len(got) >= batches:
            return got
        threading.Event().wait(0.05)
    raise AssertionError(f"{batches} batches from {start} were never sent: {got}")


def test_replay_from_a_sequence_number(ctx, publishers) -> None:
    """The ROUTER answers a start sequence number with the buffered batches from it on (the
    same topic and payloads as the live stream), then the end marker; a malformed request is
    ignored and the socket keeps serving; batches beyond the replay buffer are forgotten."""
    sub = Subscriber(ctx)
    pub = publishers(sub.endpoint, topic="kv", replay_endpoint=f"{LOOPBACK}:0",
                     replay_batches=4)
    pub.start()
    sub.sync(pub)
    live: dict[int, Any] = {}
    for h in range(1, 7):  # one batch each: wait for it before the next event
        pub.removed(DEVICE, [h])
        msg = sub.recv()
        assert msg is not None
        live[msg[1]] = msg[2]
    last = max(live)
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(pub.replay_endpoint)
    bad.send_multipart((b"", b"short"))
    got = replay(ctx, pub.replay_endpoint, last - 2)
    assert [seq for _, seq, _ in got] == [last - 2, last - 1, last]
    assert all(t == b"kv" and b == live[s] for t, s, b in got)
    assert [s for _, s, _ in replay(ctx, pub.replay_endpoint, 0)] == list(range(last - 3,
                                                                                   last + 1))
    assert replay(ctx, pub.replay_endpoint, last + 1) == []
    assert not bad.poll(0), "a malformed request gets no answer"
    bad.close()


def test_array_encoding_for_consumers_before_vllm_42892(ctx, publishers) -> None:
    """``encoding="array"``: the positional events of earlier vLLM releases, the same tags."""
    sub = Subscriber(ctx, decoder=DECODE_LEGACY)
    pub = publishers(sub.endpoint, encoding="array")
    pub.start()
    sub.sync(pub)
    pub.stored(HOST, [5, 6], None, [1, 2, 3, 4], 2)
    pub.removed(HOST, [5])
    pub.cleared()
    got = sub.events_until(lambda ev: len(per_block(ev)) >= 4)
    assert per_block(got) == [("stored", "CPU", 5, None, (1, 2)),
                              ("stored", "CPU", 6, 5, (3, 4)),
                              ("removed", "CPU", 5), ("cleared",)]
    with pytest.raises(ValueError, match="encoding"):
        ZmqKVEventPublisher(sub.endpoint, encoding="json")


def test_bound_endpoint_and_clean_close(ctx, publishers, tmp_path) -> None:
    """A wildcard or ipc endpoint is bound (vLLM's rule) and consumers connect; close() sends
    what was buffered and a closing AllBlocksCleared (the worker's KV is gone), stops the
    thread and releases the endpoint for the next worker; it is idempotent."""
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    before = set(threading.enumerate())
    pub = ZmqKVEventPublisher(endpoint, topic="t")
    assert pub.endpoint == endpoint
    pub.start()
    sub = Subscriber(ctx, connect=endpoint)
    sub.sync(pub)
    pub.stored(DEVICE, [11], None, [1, 2], 2)
    pub.close()
    got = per_block(sub.events_until(lambda ev: per_block(ev)[-1:] == [("cleared",)]
                                     and any(e[0] == "stored" for e in per_block(ev))))
    assert got[0] == ("stored", "GPU", 11, None, (1, 2)) and got[-1] == ("cleared",)
    pub.close()
    assert set(threading.enumerate()) <= before, "a thread outlived close()"
    again = ZmqKVEventPublisher(endpoint)  # the endpoint is free again
    again.close()  # never started: closes too
    unstarted = publishers(Subscriber(ctx).endpoint)
    unstarted.close()


def test_a_taken_port_fails_at_construction(ctx, publishers) -> None:
    holder = ctx.socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(zmq.ZMQError):
        ZmqKVEventPublisher(Subscriber(ctx).endpoint, replay_endpoint=f"{LOOPBACK}:{port}")
    holder.close()


def test_worker_flags() -> None:
    """Off by default; the flags reach the settings; a topic or replay socket without a stream
    is refused, as is an unknown encoding."""
    from kvrelay.cli import build_parser, worker_settings_from_args
    from kvrelay.worker.kv_events_zmq import ENCODINGS
    from kvrelay.worker.settings import KV_EVENTS_ENCODINGS, WorkerSettings

    assert KV_EVENTS_ENCODINGS == ENCODINGS
    parser = build_parser()
    base = ["worker", "--role", "both", "--model", "m"]
    assert worker_settings_from_args(parser.parse_args(base)).kv_events_endpoint is None
    st = worker_settings_from_args(parser.parse_args(base + [
        "--kv-events-endpoint", "tcp://*:5557", "--kv-events-topic", "kv@p@m",
        "--kv-events-replay-endpoint", "tcp://*:5558", "--kv-events-encoding", "array"]))
    assert (st.kv_events_endpoint, st.kv_events_topic, st.kv_events_replay_endpoint,
            st.kv_events_encoding) == ("tcp://*:5557", "kv@p@m", "tcp://*:5558", "array")
    with pytest.raises(ValueError, match="need --kv-events-endpoint"):
        WorkerSettings(role="both", kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValueError, match="need --kv-events-endpoint"):
        WorkerSettings(role="both", kv_events_topic="kv@p@m")
    with pytest.raises(ValueError, match="kv-events-encoding"):
        WorkerSettings(role="both", kv_events_endpoint="tcp://*:5557", kv_events_encoding="x")


# -- end to end: an engine's blocks, as an external router's index sees them ----------------------
def index_of(blocks: list[tuple]) -> dict[str, set[int]]:
    """What a consumer's index holds after ``blocks`` (``per_block``'s tuples), by medium;
    every removal names a block the index holds (the stream is consistent)."""
    held: dict[str, set[int]] = {}
    for b in blocks:
        if b[0] == "stored":
            held.setdefault(b[1], set()).add(b[2])
        elif b[0] == "removed":
            assert b[2] in held.get(b[1], set()), f"removal of a block never stored: {b}"
            held[b[1]].discard(b[2])
        else:
            held.clear()
    return {m: s for m, s in held.items() if s}


def until_closing_reset(sub: Subscriber) -> list[tuple]:
    """Every block event up to the reset that ``close()`` sends (excluded)."""
    got = per_block(sub.events_until(lambda ev: per_block(ev)[-1:] == [("cleared",)]))
    return got[:-1]


def test_a_worker_publishes_its_pool_as_requests_fill_and_evict_it(ctx, demo_model_dir) -> None:
    """``--kv-events-endpoint`` on a worker: each request's full blocks arrive as BlockStored
    (vLLM's chain: nil root parent, each block's tokens), a pool too small for the prompts
    evicts the first one's (BlockRemoved), the index the stream builds is the pool's, and
    stopping the worker resets it."""
    import asyncio

    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.worker.process import Worker
    from kvrelay.worker.settings import WorkerSettings

    bs = 8
    prompts = [chain(100 + i, 6, bs)[0] for i in range(4)]  # 48 tokens, 6 blocks each
    sub = Subscriber(ctx, topic="kv@")
    config = EngineConfig.from_kwargs(demo_model_dir, block_size=bs, num_blocks=16,
                                      num_threads=1, seed=0)
    settings = WorkerSettings(role="both", kv_events_endpoint=sub.endpoint,
                              kv_events_topic="kv@w0@demo")

    async def scenario() -> dict[str, set[int]]:
        worker = Worker(settings, config)
        await worker.start()
        try:
            assert worker.kv_events is not None
            await asyncio.to_thread(sub.sync, worker.kv_events)
            sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts):
                async for _ in worker.engine.generate(f"r{i}", p, sp):
                    pass
            sets = await worker.engine.call(worker.engine.core.cached_hash_sets)
            return {MEDIUM[m]: set(s) for m, s in sets.items() if s}
        finally:
            await worker.stop()

    pool = asyncio.run(scenario())
    blocks = until_closing_reset(sub)
    assert index_of(blocks) == pool
    stored = [b for b in blocks if b[0] == "stored"]
    assert {b[1] for b in blocks} == {"GPU"}
    for p in prompts:
        hashes = block_hashes(p, bs)
        mine = [b for b in stored if b[2] in hashes]
        assert [b[2] for b in mine] == hashes, "each prompt's blocks, stored once, in order"
        assert [(b[3], b[4]) for b in mine] == [
            (hashes[i - 1] if i else None, tuple(p[i * bs:(i + 1) * bs]))
            for i in range(len(hashes))]
    first = set(block_hashes(prompts[0], bs))
    assert first & {b[2] for b in blocks if b[0] == "removed"}, "the first prompt was evicted"


def test_demotion_to_the_host_tier_is_a_tier_change_in_the_stream(ctx, publishers,
                                                                  demo_model_dir) -> None:
    """With a host tier, a block the pool evicts was stored under CPU when it was published, so
    consumers still credit the prefix (at their CPU weight) after its GPU removal."""
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.sampling_params import SamplingParams

    bs, slot_bytes = 8, 6 * 2 * 8 * 4 * 32 * 4  # one block of every layer of the tiny model
    core = EngineCore(EngineConfig.from_kwargs(
        demo_model_dir, block_size=bs, num_blocks=48, max_num_batched_tokens=64, seed=0,
        num_threads=1, kv_offload_memory=128 * slot_bytes))
    sub = Subscriber(ctx)
    pub = publishers(sub.endpoint)
    pub.start()
    sub.sync(pub)
    core.set_kv_event_sink(pub)
    prompts = [chain(200 + i, 20, bs)[0] for i in range(4)]  # 160 tokens: they evict each other
    try:
        sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(f"t{i}", p, sp)
            for _ in range(500):
                if any(o.finished for o in core.step()):
                    break
        assert core.tiers is not None
        core.tiers.drain()
        core.block_manager.flush_stores()
        core.tiers.drain()
        truth = {MEDIUM[m]: set(s) for m, s in core.cached_hash_sets().items() if s}
    finally:
        core.close()
    pub.close()
    index = index_of(until_closing_reset(sub))
    assert index == truth
    first = set(block_hashes(prompts[0], bs))
    assert not first & index.get("GPU", set()) and first <= index["CPU"]
