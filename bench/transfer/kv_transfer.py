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

``--tp`` (also) / ``--tp-only`` / ``--per-rank``: the rows of ``bench/transfer/tp_splits.py``
(transfer between tensor-parallel splits, one agent per engine or per rank); ``--swa``: those of
``bench/transfer/swa_handoff.py`` (a sliding-window hybrid's handoff).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import time
from multiprocessing.connection import Connection

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from bench.transfer.rig import MODEL_ID, SPEC, MiB, answer_sums, time_median
from bench.transfer.swa_handoff import swa_rows
from bench.transfer.tp_splits import per_rank_rows, tp_rows
from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from kvrelay.kv_transfer.layout import KVLayout
from kvrelay.kv_transfer.messages import PeerInfo


def _receiver(conn: Connection) -> None:
    torch.set_num_threads(1)
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    kv = allocate_kv_cache(SPEC)
    tr = NixlTransport("bench-recv", kv, KVLayout.from_spec(SPEC, MODEL_ID))
    conn.send(tr.peer_info().to_bytes())
    # Like an engine loop waiting for KV (answers handshakes); checksums layer 0's blocks.
    answer_sums(conn, [tr], [kv[0:1]])
    tr.close()


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

    t_c, t_i, t_t = (time_median(f, reps) for f in (compute_only, inline, threaded))
    th.close()
    print(f"\noverlap: {layers} layers x (matmul + {mib} MiB KV write), median of {reps}")
    hidden = (f"{(t_i - t_t) / (t_i - t_c):.0%} of the transfer time" if t_i > t_c * 1.02
              else "n/a: too noisy, the machine is busy")
    print(f"  compute only {t_c * 1e3:7.1f} ms   write inline {t_i * 1e3:7.1f} ms   "
          f"write on the I/O thread {t_t * 1e3:7.1f} ms   (hidden: {hidden})")
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


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
        tp_rows(args.reps)
        return
    if args.per_rank:
        per_rank_rows(args.reps)
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

        t_ours, t_raw, t_copy = (time_median(f, args.reps) for f in (ours, raw, copy))
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
        tp_rows(args.reps)


if __name__ == "__main__":
    main()
