"""Benchmark KV transfer between engines whose KV heads are split over different
tensor-parallel sizes: GB/s of the same payload (every layer's K and V of 16 MiB of consecutive
blocks of the model's 8 KV heads) for each pair of splits.

    NIXL_LOG_LEVEL=WARN .venv/bin/python -m bench.transfer.tp_splits [--reps 7] [--per-rank]

(also ``python -m bench.transfer.kv_transfer --tp-only`` / ``--per-rank``).

One agent per engine (the default rows): P=1->D=1, P=2->D=2 (whole blocks rank to rank),
P=2->D=1 (each token's heads gathered from two ranks) and P=1->D=2 (split over two ranks; both
packed by the sender into a staging buffer as the receiver lays its blocks out, then sent as
whole blocks), and the last two again with the TP=1 side in two KV head groups
(``--kv-head-groups 2``: one allocation laid out as two ranks' KV, as the engine keeps it),
which go rank to rank with no repacking; then P=2->D=4 without and with the prefill ranks in
two groups each.

``--per-rank``: one agent per rank on both sides, as the engines run it
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
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch

from bench.transfer.rig import MODEL_ID, SPEC, MiB, answer_sums, time_median
from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache, kv_groups_of
from kvrelay.kv_transfer.layout import KVLayout
from kvrelay.kv_transfer.messages import PeerInfo

# The payload: 16 MiB of every layer's K and V, in consecutive blocks.
BLOCKS = list(range(16 * MiB // (SPEC.num_layers * 2 * SPEC.block_bytes)))
PAYLOAD = len(BLOCKS) * SPEC.num_layers * 2 * SPEC.block_bytes


def tp_spec(tp: int, heads_first: bool = False) -> tuple[KVCacheSpec, KVLayout]:
    """One of ``tp`` ranks' KV spec (half the payload spec's blocks) and the replica's layout."""
    n = SPEC.num_kv_heads // tp
    spec = KVCacheSpec(SPEC.num_layers, n, SPEC.head_dim, SPEC.block_size, SPEC.num_blocks // 2,
                       heads_first=heads_first)
    ranges = tuple((r * n, (r + 1) * n) for r in range(tp))
    return spec, KVLayout.from_spec(spec, MODEL_ID, head_ranges=ranges,
                                    model_kv_heads=SPEC.num_kv_heads)


def tp_kvs(spec: KVCacheSpec, tp: int, groups: int) -> list[torch.Tensor]:
    """A side's KV tensors: every rank's, or (``groups`` > 1) every rank's KV head groups, one
    allocation per rank as the engine keeps them."""
    return [g for _ in range(tp) for g in kv_groups_of(allocate_kv_cache(spec, groups=groups))]


def tp_receiver(conn: Connection, tp: int, groups: int) -> None:
    """A receiving engine of ``tp`` ranks (each in ``groups`` KV head groups), one agent."""
    torch.set_num_threads(1)
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    spec, layout = tp_spec(tp * groups)
    kvs = tp_kvs(spec, tp, groups)
    tr = NixlTransport(f"bench-tp-recv-{tp}", kvs[0], layout, rank_kvs=kvs[1:])
    conn.send(tr.peer_info().to_bytes())
    answer_sums(conn, [tr], kvs)
    tr.close()


def _rank_agents(tag: str, tp: int, heads_first: bool, fill: bool) -> tuple[list, PeerInfo]:
    """One agent per rank over its own KV, and rank 0's endpoint naming the others."""
    from kvrelay.kv_transfer.messages import RankAgent
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    spec, layout = tp_spec(tp, heads_first)
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
    answer_sums(conn, agents, [a._kv for a in agents])
    for a in agents:
        a.close()


def _write_rate(parent: Connection, senders: Sequence[Any], kvs: Sequence[torch.Tensor],
                reps: int, what: object) -> float:
    """GB/s of writing the payload from ``senders`` (each posts its part, then all are polled
    to done) to the receiver at ``parent`` once it sent its endpoint; the receiver checks that
    the bytes of ``kvs`` (the senders' KV) arrived."""
    if not parent.poll(60):
        raise SystemExit("receiver did not start")
    info = PeerInfo.from_bytes(parent.recv())
    for s in senders:
        s.add_peer(info)
    moved: list[int] = []

    def write() -> None:
        hs = [s.write(info.agent_name, None, BLOCKS, BLOCKS) for s in senders]
        for s, h in zip(senders, hs, strict=True):
            while not s.poll(h):
                pass
        moved.append(sum(h.nbytes for h in hs))

    t = time_median(write, reps)
    assert set(moved) == {PAYLOAD}, (moved, PAYLOAD)
    parent.send(BLOCKS)
    want = sum(kv[:, :, BLOCKS].double().sum().item() for kv in kvs)
    got = parent.recv() if parent.poll(30) else float("nan")
    assert abs(got - want) <= 1e-9 * abs(want), what
    return PAYLOAD / t / 1e9


def _header(what: str, reps: int) -> None:
    # The repacking rows are expected: not the warning that names the layout sparing it.
    logging.getLogger("kvrelay.kv_transfer.nixl_transport").setLevel(logging.ERROR)
    print(f"\nKV transfer {what} ({SPEC.num_kv_heads} KV heads, all {SPEC.num_layers} layers, "
          f"K and V, {PAYLOAD // MiB} MiB), median of {reps}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def tp_rows(reps: int) -> None:
    """One agent per engine, every split, with and without KV head groups."""
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    ctx = mp.get_context("spawn")
    _header("between tensor-parallel sizes", reps)
    print(f"{'P -> D':<10}{'payload MiB':>12}{'regions':>9}{'GB/s':>8}{'vs 1 -> 1':>12}"
          f"{'vs 2 -> 2':>10}   (g: that side's ranks each in 2 KV head groups)")
    same: dict[int, float] = {}
    for p_tp, d_tp, p_g, d_g in ((1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1),
                                 (2, 1, 1, 2), (1, 2, 2, 1), (2, 4, 1, 1), (2, 4, 2, 1)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=tp_receiver, args=(child, d_tp, d_g), daemon=True)
        proc.start()
        spec, layout = tp_spec(p_tp * p_g)
        kvs = tp_kvs(spec, p_tp, p_g)
        for kv in kvs:
            kv.copy_(torch.rand(spec.shape))
        tr = NixlTransport(f"bench-tp-send-{p_tp}-{d_tp}", kvs[0], layout, rank_kvs=kvs[1:],
                           write_timeout_s=60)
        gbs = _write_rate(parent, [tr], kvs, reps, (p_tp, d_tp))
        if p_tp == d_tp:
            same[p_tp] = gbs
        base = same.get(1)
        # A row per receiving rank's (or group's) block.
        n_regions = len(BLOCKS) * SPEC.num_layers * 2 * d_tp * d_g
        vs = f"{gbs / base:.0%}" if base and p_tp != d_tp else "-"
        vs2 = f"{gbs / same[2]:.0%}" if 2 in same and p_tp != d_tp else "-"
        name = f"{p_tp}{'g' * (p_g > 1)} -> {d_tp}{'g' * (d_g > 1)}"
        print(f"{name:<10}{PAYLOAD / MiB:>12.0f}{n_regions:>9}{gbs:>8.2f}{vs:>12}{vs2:>10}")
        tr.close()
        parent.send("exit")
        proc.join(10)


def per_rank_rows(reps: int) -> None:
    """One agent per rank on both sides, every split, tokens and heads first."""
    ctx = mp.get_context("spawn")
    _header("with one NIXL agent per rank", reps)
    print(f"{'P -> D':<8}{'order':>8}{'descriptors':>13}{'GB/s':>8}{'vs 1 -> 1':>11}")
    base: dict[str, float] = {}
    for order in ("tokens", "heads"):
        hf = order == "heads"
        for p_tp, d_tp in ((1, 1), (2, 2), (2, 1), (1, 2), (2, 4)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_per_rank_receiver, args=(child, d_tp, hf), daemon=True)
            proc.start()
            agents, _ = _rank_agents(f"bench-pr-send-{order}-{p_tp}-{d_tp}", p_tp, hf, True)
            gbs = _write_rate(parent, agents, [a._kv for a in agents], reps,
                              (order, p_tp, d_tp))
            if p_tp == d_tp == 1:
                base[order] = gbs
            # One per (layer, plane, block) of each run; token by token where a run is not a
            # whole block tokens first and no single sender holds every head to stage.
            runs = max(p_tp, d_tp)
            per_block = SPEC.block_size if (not hf and p_tp != d_tp and p_tp > 1) else 1
            n_desc = len(BLOCKS) * SPEC.num_layers * 2 * runs * per_block
            print(f"{f'{p_tp} -> {d_tp}':<8}{order:>8}{n_desc:>13}{gbs:>8.2f}"
                  f"{gbs / base[order]:>11.0%}")
            for a in agents:
                a.close()
            parent.send("exit")
            proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--per-rank", action="store_true",
                    help="the rows of one agent per rank, tokens and heads first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    (per_rank_rows if args.per_rank else tp_rows)(args.reps)


if __name__ == "__main__":
    main()
