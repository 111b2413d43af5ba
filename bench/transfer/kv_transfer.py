"""Benchmark the KV transport: payload GB/s beside raw NIXL and an in-process copy, idle CPU.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.kv_transfer [--reps 7] \\
        [--idle-seconds 10]

Two processes on this machine (the UCX backend moves DRAM with CMA). Rows:
  - contiguous N MiB: one layer's K and V planes for consecutive blocks (2 contiguous runs);
  - scattered: 1024 random local blocks to 1024 random remote blocks, K and V (2048 regions).
Columns: ours (``NixlTransport.write`` over prepared per-block descriptors, polled to DONE),
raw NIXL (``initialize_xfer`` over the same regions, given as few descriptors as possible),
``tensor.copy_`` within one process (one thread), and ours / raw.
Then a layer-wise overlap stand-in (per layer a cache-resident matmul, then a 16 MiB write posted
inline or handed to the I/O thread as ``save_layer`` does), and the CPU seconds an idle agent
burns over ``--idle-seconds``: ours (NIXL progress thread off) vs NIXL's default (thread on).
Numbers on a shared machine move with its load; the load average is printed beside them.

``--tp`` (or ``--tp-only``): the same payload (every layer's K and V of consecutive blocks of the
model's 8 KV heads) between engines whose heads are split over tensor-parallel ranks: P=1->D=1,
P=2->D=2 (whole blocks rank to rank), P=2->D=1 (each token's heads gathered from two ranks) and
P=1->D=2 (split over two ranks; both packed by the sender into a staging buffer as the
receiver lays its blocks out, then sent as whole blocks), and the last two again with the TP=1
side in two KV head groups (``--kv-head-groups 2``: one allocation laid out as two ranks' KV, as
the engine keeps it), which go rank to rank with no repacking; then P=2->D=4 without and with
the prefill ranks in two groups each. Every rank's KV is registered by one agent per engine.

``--per-rank``: the same payload with one agent per rank on both sides, as the engines run it
(``kv_transfer/rank_agents.py``): each sending rank posts its part from its own agent (here all
in the bench process, posted one after another, then polled together), and every block order:
tokens first (whole blocks rank to rank; other splits token by token, or staged where one
sender holds every head) and heads first (``--kv-layout heads``: a run of heads per block).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache, kv_groups_of
from kvrelay.kv_transfer.layout import KVLayout
from kvrelay.kv_transfer.messages import PeerInfo

MiB = 1 << 20
# 64 KiB blocks (16 tokens x 8 KV heads x 128 dims x fp32); 2 layers x 2 x 2048 blocks = 512 MiB
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, num_blocks=2048)
MODEL_ID = "bench-model"


def _receiver(conn: Connection) -> None:
    torch.set_num_threads(1)
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    kv = allocate_kv_cache(SPEC)
    tr = NixlTransport("bench-recv", kv, KVLayout.from_spec(SPEC, MODEL_ID))
    conn.send(tr.peer_info().to_bytes())
    while True:
        while not conn.poll(0.002):  # like an engine loop waiting for KV: answers handshakes
            tr.progress()
        cmd = conn.recv()
        if cmd == "exit":
            break
        conn.send(kv[0, :, cmd].double().sum().item())  # checksum of those blocks
    tr.close()


def _tp_spec(tp: int) -> tuple[KVCacheSpec, KVLayout]:
    n = SPEC.num_kv_heads // tp
    spec = KVCacheSpec(SPEC.num_layers, n, SPEC.head_dim, SPEC.block_size, SPEC.num_blocks // 2)
    ranges = tuple((r * n, (r + 1) * n) for r in range(tp))
    return spec, KVLayout.from_spec(spec, MODEL_ID, head_ranges=ranges,
                                    model_kv_heads=SPEC.num_kv_heads)


def _tp_kvs(spec: KVCacheSpec, tp: int, groups: int) -> list[torch.Tensor]:
    """A side's KV tensors: every rank's, or (``groups`` > 1) every rank's KV head groups, one
    allocation per rank as the engine keeps them."""
    return [g for _ in range(tp) for g in kv_groups_of(allocate_kv_cache(spec, groups=groups))]


def _tp_receiver(conn: Connection, tp: int, groups: int) -> None:
    torch.set_num_threads(1)
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    spec, layout = _tp_spec(tp * groups)
    kvs = _tp_kvs(spec, tp, groups)
    tr = NixlTransport(f"bench-tp-recv-{tp}", kvs[0], layout, rank_kvs=kvs[1:])
    conn.send(tr.peer_info().to_bytes())
    _answer_sums(conn, [tr], kvs)
    tr.close()


def _answer_sums(conn: Connection, agents: list, kvs: list[torch.Tensor]) -> None:
    """A receiver's loop: keep its agents progressing (a sender's first write waits on the
    connection handshake) and answer each list of blocks with their sum over ``kvs``, until
    "exit"."""
    while True:
        while not conn.poll(0.002):
            for a in agents:
                a.progress()
        cmd = conn.recv()
        if cmd == "exit":
            return
        conn.send(sum(kv[:, :, cmd].double().sum().item() for kv in kvs))


def _tp_rows(reps: int) -> None:
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    ctx = mp.get_context("spawn")
    # The repacking rows are expected: not the warning that names the head groups sparing it.
    logging.getLogger("kvrelay.kv_transfer.nixl_transport").setLevel(logging.ERROR)
    print(f"\nKV transfer between tensor-parallel sizes ({SPEC.num_kv_heads} KV heads, all "
          f"{SPEC.num_layers} layers, K and V), median of {reps}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'P -> D':<10}{'payload MiB':>12}{'regions':>9}{'GB/s':>8}{'vs 1 -> 1':>12}"
          f"{'vs 2 -> 2':>10}   (g: that side's ranks each in 2 KV head groups)")
    same: dict[int, float] = {}
    for p_tp, d_tp, p_g, d_g in ((1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1),
                                 (2, 1, 1, 2), (1, 2, 2, 1), (2, 4, 1, 1), (2, 4, 2, 1)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_tp_receiver, args=(child, d_tp, d_g), daemon=True)
        proc.start()
        spec, layout = _tp_spec(p_tp * p_g)
        kvs = _tp_kvs(spec, p_tp, p_g)
        for kv in kvs:
            kv.copy_(torch.rand(spec.shape))
        tr = NixlTransport(f"bench-tp-send-{p_tp}-{d_tp}", kvs[0], layout, rank_kvs=kvs[1:],
                           write_timeout_s=60)
        if not parent.poll(60):
            raise SystemExit("receiver did not start")
        info = PeerInfo.from_bytes(parent.recv())
        tr.add_peer(info)
        # The same bytes of the model's KV in every row: 16 MiB of it.
        blocks = list(range(16 * MiB // (SPEC.num_layers * 2 * SPEC.block_bytes)))
        moved: list[int] = []

        def write(blocks: list[int] = blocks, tr: NixlTransport = tr,
                  peer: str = info.agent_name, moved: list[int] = moved) -> None:
            h = tr.write(peer, None, blocks, blocks)
            moved.append(h.nbytes)
            while not tr.poll(h):
                pass

        t = _time(write, reps)
        nbytes = len(blocks) * SPEC.num_layers * 2 * SPEC.block_bytes
        assert set(moved) == {nbytes}, (moved, nbytes)
        parent.send(blocks)
        want = sum(kv[:, :, blocks].double().sum().item() for kv in kvs)
        got = parent.recv() if parent.poll(30) else float("nan")
        assert abs(got - want) <= 1e-9 * abs(want), (p_tp, d_tp)
        gbs = nbytes / t / 1e9
        if p_tp == d_tp:
            same[p_tp] = gbs
        base = same.get(1)
        # A row per receiving rank's (or group's) block.
        n_regions = len(blocks) * SPEC.num_layers * 2 * d_tp * d_g
        vs = f"{gbs / base:.0%}" if base and p_tp != d_tp else "-"
        vs2 = f"{gbs / same[2]:.0%}" if 2 in same and p_tp != d_tp else "-"
        name = f"{p_tp}{'g' * (p_g > 1)} -> {d_tp}{'g' * (d_g > 1)}"
        print(f"{name:<10}{nbytes / MiB:>12.0f}{n_regions:>9}{gbs:>8.2f}{vs:>12}{vs2:>10}")
        tr.close()
        parent.send("exit")
        proc.join(10)


def _order_spec(tp: int, heads_first: bool) -> tuple[KVCacheSpec, KVLayout]:
    n = SPEC.num_kv_heads // tp
    spec = KVCacheSpec(SPEC.num_layers, n, SPEC.head_dim, SPEC.block_size, SPEC.num_blocks // 2,
                       heads_first=heads_first)
    ranges = tuple((r * n, (r + 1) * n) for r in range(tp))
    return spec, KVLayout.from_spec(spec, MODEL_ID, head_ranges=ranges,
                                    model_kv_heads=SPEC.num_kv_heads)


def _rank_agents(tag: str, tp: int, heads_first: bool, fill: bool) -> tuple[list, PeerInfo]:
    """One agent per rank over its own KV, and rank 0's endpoint naming the others."""
    from kvrelay.kv_transfer.messages import RankAgent
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    spec, layout = _order_spec(tp, heads_first)
    agents = []
    for r in range(tp):
        kv = allocate_kv_cache(spec)
        if fill:
            kv.copy_(torch.rand(spec.shape))
        agents.append(NixlTransport(f"{tag}.r{r}" if r else tag, kv, layout, slots=(r,),
                                    write_timeout_s=60))
    ranks = [(RankAgent(a.name, a.metadata, 0, a.slots), a.slot_addresses) for a in agents[1:]]
    return agents, agents[0].peer_info(ranks)


def _per_rank_receiver(conn: Connection, tp: int, heads_first: bool) -> None:
    torch.set_num_threads(1)
    agents, info = _rank_agents(f"bench-pr-recv-{tp}", tp, heads_first, fill=False)
    conn.send(info.to_bytes())
    _answer_sums(conn, agents, [a._kv for a in agents])
    for a in agents:
        a.close()


def _per_rank_rows(reps: int) -> None:
    ctx = mp.get_context("spawn")
    logging.getLogger("kvrelay.kv_transfer.nixl_transport").setLevel(logging.ERROR)
    print(f"\nKV transfer with one NIXL agent per rank ({SPEC.num_kv_heads} KV heads, all "
          f"{SPEC.num_layers} layers, K and V, 16 MiB), median of {reps}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'P -> D':<8}{'order':>8}{'descriptors':>13}{'GB/s':>8}{'vs 1 -> 1':>11}")
    base: dict[str, float] = {}
    for order in ("tokens", "heads"):
        hf = order == "heads"
        for p_tp, d_tp in ((1, 1), (2, 2), (2, 1), (1, 2), (2, 4)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_per_rank_receiver, args=(child, d_tp, hf), daemon=True)
            proc.start()
            agents, _ = _rank_agents(f"bench-pr-send-{order}-{p_tp}-{d_tp}", p_tp, hf, True)
            if not parent.poll(60):
                raise SystemExit("receiver did not start")
            info = PeerInfo.from_bytes(parent.recv())
            for a in agents:
                a.add_peer(info)
            blocks = list(range(16 * MiB // (SPEC.num_layers * 2 * SPEC.block_bytes)))
            moved: list[int] = []

            def write(agents: list = agents, blocks: list[int] = blocks,
                      moved: list[int] = moved, peer: str = info.agent_name) -> None:
                hs = [a.write(peer, None, blocks, blocks) for a in agents]
                for a, h in zip(agents, hs, strict=True):
                    while not a.poll(h):
                        pass
                moved.append(sum(h.nbytes for h in hs))

            t = _time(write, reps)
            nbytes = len(blocks) * SPEC.num_layers * 2 * SPEC.block_bytes
            assert set(moved) == {nbytes}, (moved, nbytes)
            parent.send(blocks)
            want = sum(a._kv[:, :, blocks].double().sum().item() for a in agents)
            got = parent.recv() if parent.poll(30) else float("nan")
            assert abs(got - want) <= 1e-9 * abs(want), (order, p_tp, d_tp)
            gbs = nbytes / t / 1e9
            if p_tp == d_tp == 1:
                base[order] = gbs
            # One per (layer, plane, block) of each run; token by token where a run is not a
            # whole block tokens first and no single sender holds every head to stage.
            runs = max(p_tp, d_tp)
            per_block = SPEC.block_size if (not hf and p_tp != d_tp and p_tp > 1) else 1
            n_desc = len(blocks) * SPEC.num_layers * 2 * runs * per_block
            print(f"{f'{p_tp} -> {d_tp}':<8}{order:>8}{n_desc:>13}{gbs:>8.2f}"
                  f"{gbs / base[order]:>11.0%}")
            for a in agents:
                a.close()
            parent.send("exit")
            proc.join(10)


def _idle(conn: Connection, seconds: float, prog_thread: bool) -> None:
    """An agent with its KV registered; ours also with a connected peer and its I/O thread
    started by one write (the state of a prefill worker between requests)."""
    torch.set_num_threads(1)
    from nixl._api import nixl_agent, nixl_agent_config

    spec = KVCacheSpec(2, 2, 16, 16, 64)
    kv = allocate_kv_cache(spec)
    if prog_thread:  # NIXL's default configuration
        agent = nixl_agent(f"idle-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        agent.register_memory(kv)
    else:
        from kvrelay.kv_transfer.nixl_transport import NixlTransport
        from kvrelay.kv_transfer.transfer_thread import TransferThread, WriteJob

        layout = KVLayout.from_spec(spec, MODEL_ID)
        a = NixlTransport(f"idle-a-{os.getpid()}", kv, layout)
        b = NixlTransport(f"idle-b-{os.getpid()}", allocate_kv_cache(spec), layout)
        a.add_peer(b.peer_info())
        done: list[object] = []
        th = TransferThread(a, lambda job, err: done.append(err) or [], lambda job, err: None)
        th.submit(WriteJob(b.name, (0, 1), [0, 1], [2, 3], ("warm-up",)))
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            b.progress()
            time.sleep(0.002)
        assert done == [None], done
    time.sleep(0.5)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    conn.send((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))


def _time(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up (first touch, connection set-up)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _runs(base: int, blocks: list[int], planes: list[int],
          merge: bool) -> list[tuple[int, int, int]]:
    """(address, length, device) for each plane's blocks, adjacent blocks merged if ``merge``."""
    bb, out = SPEC.block_bytes, []
    for p in planes:
        start = prev = None
        for b in [*blocks, None]:
            if merge and b is not None and prev is not None and b == prev + 1:
                prev = b
                continue
            if start is not None:
                out.append((base + (p * SPEC.num_blocks + start) * bb, (prev - start + 1) * bb, 0))
            start = prev = b
    return out


def _overlap(tr: object, peer: str, reps: int, layers: int = 8, mib: int = 16) -> None:
    """A stand-in for layer-wise prefill: per layer, a matmul on this thread, then that layer's
    KV write, posted inline or handed to the I/O thread (what ``save_layer`` does)."""
    from kvrelay.kv_transfer.transfer_thread import TransferThread, WriteJob

    x, w = torch.rand(256, 1024), torch.rand(1024, 1024)  # cache-resident: compute-bound

    def layer() -> None:
        for _ in range(12):
            x @ w

    blocks = list(range(mib * MiB // (2 * SPEC.block_bytes)))
    done: list[object] = []
    th = TransferThread(tr, lambda job, err: done.append(err) or [], lambda job, err: None)

    def compute_only() -> None:
        for _ in range(layers):
            layer()

    def inline() -> None:
        for i in range(layers):
            layer()
            tr.wait(tr.write(peer, i % SPEC.num_layers, blocks, blocks), timeout=30)

    def threaded() -> None:
        done.clear()
        for i in range(layers):
            layer()
            th.submit(WriteJob(peer, (i % SPEC.num_layers,), blocks, blocks, ("r",)))
        deadline = time.monotonic() + 30
        while len(done) < layers and time.monotonic() < deadline:
            time.sleep(1e-4)
        assert done == [None] * layers, done

    t_c, t_i, t_t = (_time(f, reps) for f in (compute_only, inline, threaded))
    th.close()
    print(f"\noverlap: {layers} layers x (matmul + {mib} MiB KV write), median of {reps}")
    hidden = (f"{(t_i - t_t) / (t_i - t_c):.0%} of the transfer time" if t_i > t_c * 1.02
              else "n/a: too noisy, the machine is busy")
    print(f"  compute only {t_c * 1e3:7.1f} ms   write inline {t_i * 1e3:7.1f} ms   "
          f"write on the I/O thread {t_t * 1e3:7.1f} ms   (hidden: {hidden})")
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


# -- sliding-window hybrids (``--swa``): bytes and time of a prompt's handoff ------------------
# A Gemma-3-4B-like layer (4 KV heads x 256, bf16: 4 KiB of K and V per token), 12 layers (5
# local : 1 global, window 1024, as Gemma 3), a prompt of 4x the window handed over whole.
SWA_WINDOW, SWA_PROMPT, SWA_LAYERS, SWA_BS = 1024, 4096, 12, 16
SWA_SHAPES = {
    "dense GQA (every layer global)": (None,) * SWA_LAYERS,
    "Gemma 3 hybrid 5:1": tuple(None if (i + 1) % 6 == 0 else SWA_WINDOW
                                for i in range(SWA_LAYERS)),
    "all windowed (Mistral-style)": (SWA_WINDOW,) * SWA_LAYERS,
}


def _swa_spec(windows: tuple[int | None, ...]) -> KVCacheSpec:
    blocks = SWA_PROMPT // SWA_BS + 16
    return KVCacheSpec(SWA_LAYERS, 4, 256, SWA_BS, blocks, "bfloat16", layer_windows=windows)


def _swa_receiver(conn: Connection, name: str) -> None:
    """A decode worker's connector: on ("reserve", rid, blocks, notif) it expects the KV; it
    reports each request whose notification arrived."""
    torch.set_num_threads(1)
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVExpectation

    spec = _swa_spec(SWA_SHAPES["dense GQA (every layer global)"])
    kv = allocate_kv_cache(spec)
    c = NixlConnector(NixlConnectorConfig(name, MODEL_ID))
    c.register_kv_cache(kv, spec)
    conn.send(c.peer_info_bytes())
    while True:
        for rid in c.take_events().received:
            conn.send(rid)
        if conn.poll(0.001):
            cmd = conn.recv()
            if cmd == "exit":
                break
            _, rid, blocks, notif = cmd
            seq = Sequence(rid, [1] * SWA_PROMPT, SamplingParams(),
                           kv_transfer_params=KVExpectation(notif, timeout_s=60.0))
            seq.block_table = list(blocks)
            seq.status = SequenceStatus.WAITING_FOR_KV
            c.request_waiting_for_kv(seq)
    c.close()


def swa_rows(reps: int) -> list[tuple[str, int, float]]:
    """Each shape's prompt handed to a decode worker through the connectors (the engine's
    path: 512-token chunks, each step's writes posted as the step ends): (shape, bytes moved,
    median seconds from the first chunk to the notification). Printed as a table."""
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence, SequenceStatus
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVDestination

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    recv_name = f"swa-recv-{os.getpid()}"
    proc = ctx.Process(target=_swa_receiver, args=(child, recv_name), daemon=True)
    proc.start()
    if not parent.poll(60):
        raise SystemExit("receiver did not start")
    info = parent.recv()
    n = SWA_PROMPT // SWA_BS
    rows = []
    for label, windows in SWA_SHAPES.items():
        spec = _swa_spec(windows)
        kv = allocate_kv_cache(spec)
        kv.view(torch.int16).random_(-1000, 1000)  # finite bf16 values
        c = NixlConnector(NixlConnectorConfig(f"swa-send-{len(rows)}-{os.getpid()}", MODEL_ID,
                                              layerwise="off", write_timeout_s=60))
        c.register_kv_cache(kv, spec)
        c.add_peer(info)
        transport = c._tx.transport
        moved: list[int] = []
        post = transport.write

        def counted(*a: object, post: Callable[..., object] = post, moved: list[int] = moved,
                    **k: object) -> object:
            h = post(*a, **k)
            moved.append(h.nbytes)  # type: ignore[attr-defined]
            return h

        transport.write = counted  # type: ignore[method-assign]
        rep = [0]

        def handoff(c: NixlConnector = c, rep: list[int] = rep, label: str = label) -> None:
            rep[0] += 1
            rid, notif = f"{label[:5]}-{rep[0]}", f"n-{label[:5]}-{rep[0]}".encode()
            parent.send(("reserve", rid, list(range(n)), notif))
            seq = Sequence(rid, [1] * SWA_PROMPT, SamplingParams(),
                           kv_transfer_params=KVDestination(recv_name, list(range(n)), 0, notif))
            seq.block_table = list(range(n))
            seq.status = SequenceStatus.RUNNING
            time.sleep(0.05)  # the reservation is open before the first write lands
            for start in range(0, SWA_PROMPT, 512):
                c.start_step([ScheduledSeq(seq, 512)])
                c.end_step()
                seq.num_computed_tokens = start + 512
            assert c.request_finished(seq)
            while rid not in c.take_events().sent:
                time.sleep(1e-4)
            assert parent.poll(30) and parent.recv() == rid

        moved.clear()
        handoff()  # warm-up, and the bytes of one handoff
        nbytes = sum(moved)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            handoff()
            times.append(time.perf_counter() - t0 - 0.05)
        rows.append((label, nbytes, statistics.median(times)))
        c.close()
    parent.send("exit")
    proc.join(10)
    dense = rows[0][1]
    print(f"\nsliding-window KV handoff: {SWA_LAYERS} layers x 4 KV heads x 256 bf16, window "
          f"{SWA_WINDOW}, prompt {SWA_PROMPT} tokens, median of {reps}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':<34}{'MiB moved':>10}{'KiB/token':>11}{'vs dense':>10}{'ms/1K tok':>11}")
    for label, nbytes, t in rows:
        print(f"{label:<34}{nbytes / MiB:>10.1f}{nbytes / SWA_PROMPT / 1024:>11.2f}"
              f"{nbytes / dense:>10.1%}{t * 1e3 / (SWA_PROMPT / 1000):>11.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--tp", action="store_true", help="also the tensor-parallel rows")
    ap.add_argument("--tp-only", action="store_true", help="only the tensor-parallel rows")
    ap.add_argument("--per-rank", action="store_true",
                    help="only the rows of one agent per rank, tokens and heads first")
    ap.add_argument("--swa", action="store_true",
                    help="only the sliding-window rows: a handoff's bytes and time, dense vs "
                         "windowed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.swa:
        swa_rows(args.reps)
        return
    if args.tp_only:
        _tp_rows(args.reps)
        return
    if args.per_rank:
        _per_rank_rows(args.reps)
        return
    from nixl._api import nixl_agent

    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    kv = allocate_kv_cache(SPEC)
    kv.copy_(torch.rand(SPEC.shape))
    tr = NixlTransport("bench-send", kv, KVLayout.from_spec(SPEC, MODEL_ID), write_timeout_s=60)
    if not parent.poll(60):
        raise SystemExit("receiver did not start")
    info = PeerInfo.from_bytes(parent.recv())
    tr.add_peer(info)
    agent: nixl_agent = tr._agent  # the same agent and connection: raw NIXL beside ours
    dst = torch.empty_like(kv)  # for the in-process copy

    rnd = random.Random(0)
    cases = [(f"contiguous {m} MiB", list(range(m * MiB // (2 * SPEC.block_bytes))),
              None) for m in (1, 16, 256)]
    cases.append(("scattered 1024 blocks", rnd.sample(range(SPEC.num_blocks), 1024),
                  rnd.sample(range(SPEC.num_blocks), 1024)))
    print(f"KV transfer, {SPEC.block_bytes // 1024} KiB blocks, median of {args.reps}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'payload':<24}{'MiB':>7}{'regions':>9}{'ours GB/s':>11}{'raw GB/s':>10}"
          f"{'copy_ GB/s':>12}{'ours/raw':>10}")
    for label, local, remote in cases:
        remote = remote or local
        nbytes = 2 * len(local) * SPEC.block_bytes

        def ours(local=local, remote=remote) -> None:
            h = tr.write(info.agent_name, 0, local, remote)
            while not tr.poll(h):
                pass

        merge = remote is local  # contiguous on both sides: as few descriptors as possible
        ldescs = agent.get_xfer_descs(_runs(kv.data_ptr(), local, [0, 1], merge), "DRAM")
        rdescs = agent.get_xfer_descs(_runs(info.base_address, remote, [0, 1], merge), "DRAM")

        def raw(ldescs=ldescs, rdescs=rdescs) -> None:
            h = agent.initialize_xfer("WRITE", ldescs, rdescs, info.agent_name)
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            assert state == "DONE", state
            agent.release_xfer_handle(h)

        li, ri = torch.tensor(local), torch.tensor(remote)

        def copy(li=li, ri=ri, contiguous=remote is local and local == list(
                range(local[0], local[0] + len(local)))) -> None:
            if contiguous:
                dst[0, :, ri[0]:ri[0] + len(ri)].copy_(kv[0, :, li[0]:li[0] + len(li)])
            else:
                dst[0].index_copy_(1, ri, kv[0].index_select(1, li))

        t_ours, t_raw, t_copy = (_time(f, args.reps) for f in (ours, raw, copy))
        g = [nbytes / t / 1e9 for t in (t_ours, t_raw, t_copy)]
        print(f"{label:<24}{nbytes / MiB:>7.0f}{ldescs.descCount():>9}{g[0]:>11.2f}{g[1]:>10.2f}"
              f"{g[2]:>12.2f}{t_raw / t_ours:>9.0%}")
        parent.send(remote)  # the bytes arrived (checksum over the blocks at the receiver)
        want = kv[0, :, local].double().sum().item()
        assert parent.poll(30) and abs(parent.recv() - want) <= 1e-9 * abs(want), label
    _overlap(tr, info.agent_name, args.reps)
    tr.close()
    parent.send("exit")
    proc.join(10)

    print(f"\nidle agent, CPU seconds over {args.idle_seconds:g} s (whole process):")
    for label, prog in (("ours (progress thread off)", False),
                        ("NIXL default (progress thread on)", True)):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_idle, args=(b, args.idle_seconds, prog), daemon=True)
        p.start()
        cpu = a.recv() if a.poll(args.idle_seconds + 60) else float("nan")
        p.join(10)
        print(f"  {label:<36}{cpu:>7.3f} s  ({cpu / args.idle_seconds:.1%} of a core)")
    if args.tp:
        _tp_rows(args.reps)


if __name__ == "__main__":
    main()
