"""Time to first token of a prompt whose KV the engine recomputes, promotes from the host tier,
or loads from the disk tier: the crossover that says when a KV tier pays (issue 52).

    .venv/bin/python -m bench.engine.tier_load [--model DIR] [--lengths 512,2048,8192]

With no ``--model`` it writes the ~150M demo Llama in bf16 (context stretched to 16K: random
weights, so only the cost matters). For each prompt length N, in one engine whose pool holds
~1.1 N tokens, a host tier ~2.2 N and a disk tier much more:

  1. P (N tokens) computed from scratch: **recompute** (its blocks are stored as it runs: the
     write-through store is part of this time);
  2. Q (another N) evicts P from the pool; P again: **host** (promotion + the last token);
  3. R and S push P out of the host tier to disk; P again: **disk** (file reads on the tier's IO
     thread, verified, then promotion + the last token).

The disk reads hit the OS page cache when the files were written moments before (as here): the
disk row is the tier's own cost (read, CRC, copies), not a cold device's. Printed: seconds and
the speed-up over recompute, median over ``--reps`` runs.

Then a convoy: P pushed to disk again, one request of P plus a last token of its own,
timed to its first token; P pushed to disk again, 8 such requests at once, timed until all have
their first token. ``convoy 8/1`` is the ratio: requests sharing a prefix being loaded wait on
the same loads (each block is read once), not on one another (LMCache users saw 12x TTFT when
every request loaded its own copy). The same two with P already in the pool give ``pool 8/1``:
what eight rows cost to compute against one, loads or not (on a 2-core CPU a step of eight
rows of the ~150M model is compute-bound: ~2.5x one row). ``8 load/pool`` is what loading P
adds to the eight: the convoy's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench.engine.core_runs import prompt
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tiers.media import DISK, HOST

BLOCK = 16
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
CONVOY = 8  # requests sharing one prefix being loaded


def ttft(core: EngineCore, rid: str, tokens: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    core.add_request(rid, tokens, FIRST)
    cached = 0
    while core.has_unfinished():
        for o in core.step():
            cached = max(cached, o.num_cached_tokens)
    return time.perf_counter() - t, cached


def push_to_disk(core: EngineCore, others: list[list[int]]) -> None:
    """Run ``others`` through the engine (out of the pool and host tier goes what came before),
    then wait for the disk tier's writes."""
    for i, o in enumerate(others):
        ttft(core, f"push{time.perf_counter_ns()}-{i}", o)
    assert core.tiers is not None
    core.tiers.drain()


def one_length(model: str, n: int, threads: int, disk_dir: str, seed: int) -> dict[str, float]:
    blocks = n // BLOCK
    slot_probe = EngineCore(EngineConfig.from_kwargs(model, num_blocks=4, num_threads=threads))
    slot_bytes = slot_probe.runner.kv_spec.bytes_per_block_all_layers
    vocab = slot_probe.vocab_size
    del slot_probe
    room = blocks * 11 // 10 + 2 + 2 * CONVOY  # (+ the convoy's own blocks)
    core = EngineCore(EngineConfig.from_kwargs(
        model, num_blocks=room, num_threads=threads, block_size=BLOCK,
        max_num_batched_tokens=2048, long_prefill_threshold=2048, max_model_len=n + 64,
        kv_offload_memory=2 * room * slot_bytes, kv_offload_dir=disk_dir,
        kv_offload_disk=8 * room * slot_bytes), eos_token_ids=frozenset())
    try:
        p, q, r, s = (prompt(n, seed * 10 + k, vocab) for k in range(4))
        ttft(core, "warm", prompt(64, seed * 10 + 9, vocab))  # first-step costs off the rows
        out: dict[str, float] = {}
        assert core.tiers is not None
        out["recompute"], _ = ttft(core, "p0", p)
        ttft(core, "q", q)
        core.tiers.drain()  # (nothing should be in flight: stores into host are synchronous)
        out["host"], cached = ttft(core, "p1", p)
        assert cached >= (n - 1) // BLOCK * BLOCK - BLOCK, f"host: only {cached} cached"
        ttft(core, "r", r)
        ttft(core, "s", s)
        core.tiers.drain()  # the spills of P have landed on disk
        out["disk"], cached = ttft(core, "p2", p)
        assert cached >= (n - 1) // BLOCK * BLOCK - BLOCK, f"disk: only {cached} cached"
        st = core.stats().kv_tiers
        out["host_ms_per_block"] = st[HOST].load_seconds_per_block * 1e3
        out["disk_ms_per_block"] = st[DISK].load_seconds_per_block * 1e3
        # A convoy: CONVOY requests sharing P (each with a suffix of its own) arrive together
        # while P is on disk; they wait on the same loads, not on each other's.
        # Then the same requests with P already in the pool (a request of P alone just ran):
        # what their rows cost to compute, with nothing to load.
        for k, first, hot in ((1, "t", False), (CONVOY, "u", False), (1, "v", True),
                              (CONVOY, "w", True)):
            if hot:
                ttft(core, f"{first}-hot", p)
            else:
                push_to_disk(core, [q, r, s])
            suffixes = [prompt(1, seed * 100 + k * 10 + j, vocab) for j in range(k)]
            t = time.perf_counter()
            for j, suf in enumerate(suffixes):
                core.add_request(f"{first}{j}", p + suf, FIRST)
            while core.has_unfinished():
                core.step()
            out[f"{'pool' if hot else 'convoy'}{k}"] = time.perf_counter() - t
        return out
    finally:
        core.close()


def no_reuse_cost(model: str, threads: int, disk_dir: str, n: int, rounds: int
                  ) -> dict[str, float]:
    """Fresh prompts only (nothing to load, every block stored): the same prompts through an
    engine without tiers and one with host and disk tiers, taking turns prompt by prompt in one
    process (which goes first alternates); each round ``n`` prompt tokens, then 32 decode steps.
    Returns the seconds summed over the rounds (``plain``, ``tiered``, ``dplain``,
    ``dtiered``) and the median and quartiles of each round's own ratios, tiered / plain
    (``ttft_x``, ``decode_x`` and their ``_q1``/``_q3``): a pair taken back to back sees the
    same host, and the median of many pairs is what a drifting host lets one bound."""
    probe = EngineCore(EngineConfig.from_kwargs(model, num_blocks=4, num_threads=threads))
    slot_bytes, vocab = probe.runner.kv_spec.bytes_per_block_all_layers, probe.vocab_size
    del probe
    room = 2 * (n + 64) // BLOCK + 4  # two prompts: the pool evicts, the tiers store
    kw: dict[str, object] = dict(num_blocks=room, num_threads=threads, block_size=BLOCK,
                                 max_num_batched_tokens=2048, long_prefill_threshold=2048,
                                 max_model_len=n + 64)
    plain = EngineCore(EngineConfig.from_kwargs(model, **kw), eos_token_ids=frozenset())
    tiered = EngineCore(EngineConfig.from_kwargs(
        model, kv_offload_memory=4 * room * slot_bytes, kv_offload_dir=disk_dir,
        kv_offload_disk=16 * room * slot_bytes, **kw), eos_token_ids=frozenset())
    decode = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    totals = [0.0, 0.0, 0.0, 0.0]
    ratios: dict[str, list[float]] = {"ttft_x": [], "decode_x": []}
    try:
        for core in (plain, tiered):
            ttft(core, "warm", prompt(64, 999, vocab))
        for i in range(rounds):
            p = prompt(n, 5000 + i, vocab)
            pair = [0.0, 0.0, 0.0, 0.0]
            for core in (plain, tiered) if i % 2 == 0 else (tiered, plain):
                k = 0 if core is plain else 1
                t = time.perf_counter()
                core.add_request(f"f{i}", p, decode)
                first = None
                while core.has_unfinished():
                    if core.step() and first is None:
                        first = time.perf_counter()
                assert first is not None
                pair[k] = first - t
                pair[2 + k] = time.perf_counter() - first
            # Spills still queued behind the tiered engine's turn would run during the plain
            # engine's next one and be charged to it: they finish here, untimed. What the
            # ratios show is what stores and spills cost the request they overlap.
            assert tiered.tiers is not None
            tiered.tiers.drain()
            totals = [a + b for a, b in zip(totals, pair, strict=True)]
            ratios["ttft_x"].append(pair[1] / pair[0])
            ratios["decode_x"].append(pair[3] / pair[2])
    finally:
        tiered.close()
    out = dict(zip(("plain", "tiered", "dplain", "dtiered"), totals, strict=True))
    for key, xs in ratios.items():
        q1, q2, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
        out[key], out[key + "_q1"], out[key + "_q3"] = q2, q1, q3
    return out

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-reuse", type=int, default=8,
                    help="fresh prompts for the tiers' cost where nothing is reused (0: skip)")
    ap.add_argument("--no-reuse-tokens", type=int, default=2048)
    ap.add_argument("--only-no-reuse", action="store_true", help="skip the load/recompute rows")
    ap.add_argument("--disk-dir", default=None,
                    help="where the disk tiers' files go (default: a temporary folder; "
                         "/dev/shm for a tier in shared memory)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvrelay-tier-")
    disk = tmp if args.disk_dir is None else tempfile.mkdtemp(prefix="kvrelay-tier-",
                                                              dir=args.disk_dir)
    model = args.model
    if model is None:
        from kvrelay.engine.demo_model import write_demo_model

        model = write_demo_model(os.path.join(tmp, "base"), size="base", seed=0)
        cfg_path = os.path.join(model, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["max_position_embeddings"] = 16384
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    print(f"model {model}, {args.threads} threads, median of {args.reps}")
    print(f"{'tokens':>7} {'recompute s':>12} {'host s':>8} {'disk s':>8} {'host x':>7} "
          f"{'disk x':>7} {'host ms/blk':>12} {'disk ms/blk':>12} {'convoy 8/1':>11} "
          f"{'pool 8/1':>9} {'8 load/pool':>12}")
    for n in () if args.only_no_reuse else (int(x) for x in args.lengths.split(",")):
        rows = [one_length(model, n, args.threads, os.path.join(disk, f"disk-{n}-{k}"), k)
                for k in range(args.reps)]
        for r in rows:  # each run's own ratios (paired: the machine's speed drifts)
            r["host_x"], r["disk_x"] = r["recompute"] / r["host"], r["recompute"] / r["disk"]
            r["convoy_x"] = r[f"convoy{CONVOY}"] / r["convoy1"]
            r["pool_x"] = r[f"pool{CONVOY}"] / r["pool1"]
            r["load_pool_x"] = r[f"convoy{CONVOY}"] / r[f"pool{CONVOY}"]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{n:>7} {med['recompute']:>12.3f} {med['host']:>8.3f} {med['disk']:>8.3f} "
              f"{med['host_x']:>7.1f} {med['disk_x']:>7.1f} "
              f"{med['host_ms_per_block']:>12.3f} {med['disk_ms_per_block']:>12.3f} "
              f"{med['convoy_x']:>11.2f} {med['pool_x']:>9.2f} {med['load_pool_x']:>12.2f}",
              flush=True)
    if args.no_reuse:
        n = args.no_reuse_tokens
        r = no_reuse_cost(model, args.threads, os.path.join(disk, "disk-fresh"), n,
                          args.no_reuse)
        print(f"\nno reuse ({args.no_reuse} fresh {n}-token prompts, the engines taking turns): "
              f"prefill {r['plain']:.2f} s without tiers, {r['tiered']:.2f} s with; 32 decode "
              f"steps {r['dplain']:.2f} s / {r['dtiered']:.2f} s\n"
              f"  with / without, median of the rounds' own ratios [quartiles]: time to first "
              f"token {r['ttft_x']:.3f} [{r['ttft_x_q1']:.3f}, {r['ttft_x_q3']:.3f}], decode "
              f"{r['decode_x']:.3f} [{r['decode_x_q1']:.3f}, {r['decode_x_q3']:.3f}], load "
              f"average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
