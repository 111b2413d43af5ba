"""A live run of the demo cluster on a local Ray, replaying a trace open-loop, beside the same
trace in the simulator.

    .venv/bin/python bench/planner_live.py --mode planner --shape ramp --peak-rate 40 \\
        --duration 180 --out bench/results/planner/live_ramp
    .venv/bin/python bench/planner_live.py --mode static --shape steady --peak-rate 20 \\
        --duration 60 --out bench/results/planner/live_static

``planner``: ``kvrelay serve --planner`` from 1P1D, at most ``--max-replicas`` (2+2 here);
``static``: fixed ``--prefill``/``--decode``. ``--calibrate-rate R`` first replays a steady
low-load trace (``--calibrate-duration`` s at R req/s) on the same cluster and corrects the
profile from it (``deploy/planner/calibrate.py``) before the main trace is compared with the
simulator. Requests are token ids; a request's hash ids
become its leading token blocks, so shared prefixes really share prefix-cache blocks. Writes
``live.json`` (requests, replica counts and planner decisions over time, live vs simulated
TTFT/ITL p90) and ``timeline.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvrelay.deploy.planner.calibrate import calibrate
from kvrelay.deploy.planner.planner import Planner
from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.simulator import SimConfig, simulate
from kvrelay.deploy.planner.trace import HASH_BLOCK, TraceRequest, generate, shapes

HERE = Path(__file__).resolve().parent


def token_ids(r: TraceRequest, vocab: int = 4000) -> list[int]:
    out: list[int] = []
    for h in r.hash_ids:
        rng = random.Random(h)
        out += [rng.randrange(7, vocab) for _ in range(HASH_BLOCK)]
    return out[:r.prompt_len]


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else 0.0


def replay(target: str, trace: list[TraceRequest], workers: int = 48) -> list[dict[str, Any]]:
    from kvrelay.client import Client, sampling

    local = threading.local()
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    t0 = time.monotonic() + 1.0

    def one(r: TraceRequest) -> None:
        if not hasattr(local, "c"):
            local.c = Client(target)
        time.sleep(max(0.0, t0 + r.t - time.monotonic()))
        row: dict[str, Any] = {"t": r.t, "prompt": r.prompt_len, "output": r.output_len}
        try:
            c = local.c.generate(token_ids(r), sampling(r.output_len, 0.0, ignore_eos=True),
                                 timeout=120)
            row.update(ok=c.finish_reason == "length", ttft_ms=c.timing.ttft_ms,
                       itl_ms=c.timing.mean_itl_ms, cached=c.usage.cached_prompt_tokens)
        except Exception as e:  # recorded: the run reports failures
            row.update(ok=False, error=repr(e)[:200])
        with lock:
            out.append(row)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, trace))
    return sorted(out, key=lambda x: x["t"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".demo-model")
    ap.add_argument("--profile", default=str(HERE / "results/planner/profile-demo-1thread.json"))
    ap.add_argument("--mode", choices=["planner", "static"], default="planner")
    ap.add_argument("--shape", default="ramp")
    ap.add_argument("--peak-rate", type=float, default=40.0)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--prompt", type=float, default=512)
    ap.add_argument("--output", type=float, default=32)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--ttft-slo-ms", type=float, default=300)
    ap.add_argument("--itl-slo-ms", type=float, default=30)
    ap.add_argument("--startup", type=float, default=6.0, help="replica start-up (s)")
    ap.add_argument("--burst-memory", type=float, default=30.0)
    ap.add_argument("--calibrate-rate", type=float, default=0.0,
                    help="req/s of a steady low-load run before the trace (0: none)")
    ap.add_argument("--calibrate-duration", type=float, default=30.0)
    ap.add_argument("--out", default=str(HERE / "results/planner/live"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = shapes(a.peak_rate, a.duration, a.prompt, a.output)[a.shape]
    trace = generate(shape, seed=7, max_len=1800)

    from kvrelay.cli import build_parser
    from kvrelay.deploy.ray_cli import build_spec, init_ray

    argv = ["serve", "--model", a.model, "--prefill", str(a.prefill), "--decode", str(a.decode),
            "--grpc-port", "0", "--control-port", "0", "--http-port", "-1",
            "--kv-cache-memory", "96MiB", "--heartbeat-interval", "0.5",
            "--log-level", "WARNING"]
    if a.mode == "planner":
        argv += ["--planner", "--profile", a.profile, "--ttft-slo-ms", str(a.ttft_slo_ms),
                 "--itl-slo-ms", str(a.itl_slo_ms), "--max-replicas", str(a.max_replicas),
                 "--planner-interval", "1", "--planner-down-delay", "10",
                 "--planner-burst-memory", str(a.burst_memory),
                 "--replica-startup", str(a.startup)]
    args = build_parser().parse_args(argv)
    init_ray(None, num_cpus=8, object_store_memory="96MiB")
    spec = build_spec(args, loopback=True)
    from kvrelay.deploy.launcher import start

    handle, info = start(spec)
    counts: list[dict[str, Any]] = []
    stop = threading.Event()

    wall0 = time.time() + 1.0  # the trace's time zero (replay starts 1 s after this)

    def poll() -> None:
        while not stop.wait(1.0):
            counts.append({"t": time.monotonic(), **handle.status()["counts"]})
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    # The steady shape runs at 0.6x its peak: ask for the peak that gives --calibrate-rate.
    cal_trace = generate(shapes(a.calibrate_rate / 0.6, a.calibrate_duration, a.prompt,
                                a.output)["steady"], seed=8, max_len=1800) \
        if a.calibrate_rate > 0 else []
    cal_rows: list[dict[str, Any]] = []
    try:
        if cal_trace:
            cal_rows = replay(f"127.0.0.1:{info['port']}", cal_trace)
            time.sleep(2)
            wall0 = time.time() + 1.0
        mono0 = time.monotonic() + 1.0  # the main trace's time zero
        rows = replay(f"127.0.0.1:{info['port']}", trace)
        time.sleep(2)
        decisions = handle.status()["decisions"]
    finally:
        stop.set()
        poller.join()
        handle.shutdown()
    ok = [r for r in rows if r["ok"]]
    met = sum(1 for r in ok if r["ttft_ms"] <= a.ttft_slo_ms and r["itl_ms"] <= a.itl_slo_ms)
    profile = Profile.load(a.profile)
    sim_cfg = SimConfig(a.ttft_slo_ms, a.itl_slo_ms, prefill=a.prefill, decode=a.decode,
                        interval_s=1.0, startup_s=a.startup)
    cal = None
    if cal_rows:
        cal_ok = [r for r in cal_rows if r["ok"]]
        cal = calibrate(profile, cal_trace, sim_cfg,
                        live_ttft_p90_ms=p90([r["ttft_ms"] for r in cal_ok]),
                        live_itl_p90_ms=p90([r["itl_ms"] for r in cal_ok if r["output"] > 1]))
        uncorrected = simulate(profile, trace, sim_cfg,
                               Planner(profile, spec.planner.config)
                               if a.mode == "planner" else None)
        profile = cal.apply(profile)
    policy = None
    if a.mode == "planner":
        policy = Planner(profile, spec.planner.config)
    sim = simulate(profile, trace, sim_cfg, policy)
    live = {"ttft_p90_ms": p90([r["ttft_ms"] for r in ok]),
            "itl_p90_ms": p90([r["itl_ms"] for r in ok if r["output"] > 1]),
            "attainment": met / len(rows), "failed": len(rows) - len(ok), "requests": len(rows)}
    simd = {"ttft_p90_ms": sim.ttft_p90_ms, "itl_p90_ms": sim.itl_p90_ms,
            "attainment": sim.attainment, "failed": sim.failed}
    err = {k: (simd[k] - live[k]) / live[k] for k in ("ttft_p90_ms", "itl_p90_ms") if live[k]}
    if cal is not None:
        simd["uncorrected_ttft_p90_ms"] = uncorrected.ttft_p90_ms
        simd["uncorrected_itl_p90_ms"] = uncorrected.itl_p90_ms
    for d in decisions:
        d["t_run"] = d["t"] - wall0
    for c in counts:
        c["t"] -= mono0
    doc = {"args": vars(a), "live": live, "sim": simd, "sim_rel_error": err,
           "calibration": None if cal is None else vars(cal), "counts": counts,
           "decisions": decisions, "requests": rows, "sim_timeline": sim.timeline}
    (out / "live.json").write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps({"live": live, "sim": simd, "sim_rel_error": err,
                      "calibration": doc["calibration"]}, indent=1))
    plot(doc, out / "timeline.png")


def plot(doc: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows, counts = doc["requests"], doc["counts"]
    fig, ax = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    ts = [r["t"] for r in rows]
    if ts:
        bins = max(1, int(max(ts) / 5))
        ax[0].hist(ts, bins=bins, weights=[bins / max(ts)] * len(ts), histtype="step",
                   label="arrivals (req/s)")
    ax[0].legend(fontsize=8)
    for pool, c in (("prefill", "C0"), ("decode", "C1")):
        ax[1].step([x["t"] for x in counts], [x[pool] for x in counts], where="post",
                   color=c, label=pool)
    for d in doc["decisions"]:
        ax[1].annotate(f"{d['pool'][0].upper()}{d['from']}->{d['to']}",
                       (d["t_run"], d["to"] + 0.05), fontsize=6)
    ax[1].set_ylabel("replicas")
    ax[1].legend(fontsize=8)
    ok = [r for r in rows if r["ok"]]
    ax[2].plot([r["t"] for r in ok], [r["ttft_ms"] for r in ok], ".", ms=2, label="TTFT ms")
    ax[2].plot([r["t"] for r in ok], [10 * r["itl_ms"] for r in ok], ".", ms=2,
               label="10 x ITL ms")
    ax[2].axhline(doc["args"]["ttft_slo_ms"], ls="--", lw=0.6, color="C0")
    ax[2].axhline(10 * doc["args"]["itl_slo_ms"], ls="--", lw=0.6, color="C1")
    ax[2].set_yscale("log")
    ax[2].set_xlabel("s")
    ax[2].legend(fontsize=8)
    fig.suptitle(f"live {doc['args']['mode']} run, {doc['args']['shape']} trace "
                 "(2-core machine shared with other engineers' tests)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
