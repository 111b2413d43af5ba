"""What one NIXL write costs per descriptor, between two processes on this machine (UCX, CMA).

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.nixl_probe [--mib 8] [--reps 7]

Moves the same ``--mib`` MiB from one KV tensor to another process's, cut into regions of 8 KiB
to the whole payload, three ways: prepared lists (``prep_xfer_dlist`` once, then
``make_prepped_xfer`` by index, what ``NixlTransport`` does) with the regions adjacent on both
sides, the same with every other region (strided), and per-write descriptors
(``initialize_xfer``) with adjacent regions. Prints the median time, GB/s and microseconds per
region. On a 2-vCPU Zen 4 (2026-11-27): prepared adjacent regions merge into one copy (1024 x
8 KiB as fast as one 8 MiB region), strided ones cost ~3.8 us each, and per-write descriptors
never merge (~3.4 us each) — why equal TP splits write through prepared lists of every rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np

from bench.transfer.tp_splits import tp_receiver, tp_spec


def _rows(base: int, offsets: np.ndarray, size: int) -> np.ndarray:
    n = offsets.size
    return np.stack([np.uint64(base) + offsets, np.full(n, size, np.uint64),
                     np.zeros(n, np.uint64)], axis=1)


def main() -> None:
    import multiprocessing as mp

    import torch

    from kvrelay.engine.kv_cache import allocate_kv_cache
    from kvrelay.kv_transfer.messages import PeerInfo
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=tp_receiver, args=(child, 1, 1), daemon=True)
    proc.start()
    spec, layout = tp_spec(1)
    kv = allocate_kv_cache(spec)
    kv.copy_(torch.rand(spec.shape))
    tr = NixlTransport("probe-send", kv, layout, write_timeout_s=60)
    if not parent.poll(60):
        raise SystemExit("receiver did not start")
    info = PeerInfo.from_bytes(parent.recv())
    tr.add_peer(info)
    agent, total = tr._agent, a.mib << 20  # the transport's agent and connection
    assert 2 * total <= kv.numel() * kv.element_size(), "--mib too large for the probe's KV"

    def timed(make) -> float:
        ts = []
        for _ in range(a.reps):
            x = make()
            t = time.perf_counter()
            state = agent.transfer(x)
            while state == "PROC":
                state = agent.check_xfer_state(x)
            ts.append(time.perf_counter() - t)
            assert state == "DONE", state
            agent.release_xfer_handle(x)
        return statistics.median(ts)

    print(f"NIXL write of {a.mib} MiB between two processes, median of {a.reps}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'descriptors':<24}{'region KiB':>11}{'regions':>9}{'ms':>8}{'GB/s':>7}"
          f"{'us/region':>11}")
    for size in (8 << 10, 32 << 10, 64 << 10, 256 << 10, total):
        n = total // size
        for label, stride, prepped in (("prepared, adjacent", 1, True),
                                       ("prepared, strided", 2, True),
                                       ("per-write, adjacent", 1, False)):
            if n == 1 and label != "prepared, adjacent":
                continue
            m = n * stride
            offs = np.arange(m, dtype=np.uint64) * np.uint64(size)
            src, dst = _rows(kv.data_ptr(), offs, size), _rows(info.base_address, offs, size)
            idx = list(range(0, m, stride))
            if prepped:
                ls = agent.prep_xfer_dlist("NIXL_INIT_AGENT", src, "DRAM")
                rs = agent.prep_xfer_dlist(info.agent_name, dst, "DRAM")
                t = timed(lambda ls=ls, rs=rs, idx=idx: agent.make_prepped_xfer(
                    "WRITE", ls, idx, rs, idx))
                ls.release()
                rs.release()
            else:
                sd = agent.get_xfer_descs(src[idx], "DRAM")
                dd = agent.get_xfer_descs(dst[idx], "DRAM")
                t = timed(lambda sd=sd, dd=dd: agent.initialize_xfer("WRITE", sd, dd,
                                                                     info.agent_name))
            print(f"{label:<24}{size >> 10:>11}{n:>9}{t * 1e3:>8.2f}{total / t / 1e9:>7.2f}"
                  f"{t / n * 1e6:>11.2f}")
    tr.close()
    parent.send("exit")
    proc.join(10)


if __name__ == "__main__":
    main()
