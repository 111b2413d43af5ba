"""A live run of the demo cluster on a local Ray, replaying a trace open-loop, beside the same
trace in the simulator.

    .venv/bin/python -m bench.planner.planner_live --mode planner --shape ramp --peak-rate 40 \\
        --duration 180 --out bench/results/planner/live_ramp
    .venv/bin/python -m bench.planner.planner_live --mode static --shape steady --peak-rate 20 \\
        --duration 60 --out bench/results/planner/live_static

``planner``: ``kvrelay serve --planner`` from 1P1D, at most ``--max-replicas`` (2+2 here);
``static``: fixed ``--prefill``/``--decode``. ``--calibrate-rate R`` first replays a steady
low-load trace (``--calibrate-duration`` s at R req/s) on the same cluster and corrects the
profile from it (``deploy/planner/calibrate.py``) before the main trace is compared with the
simulator, calibrated both ways: co-located (the pools share this host's cores: the TTFT gap is
contention, ``contention.py``; what ``sim`` holds) and as if on hardware of their own (a fixed
hand-off; ``sim_separate``). The simulator replays the calibration phase first, as the cluster
served it (its prefix cache stays warm for the trace), and measures the trace alone. Requests are
token ids; a request's hash ids become its leading token blocks, so shared prefixes really share
prefix-cache blocks. Writes ``live.json`` (requests, the calibration phase's too, replica counts
and planner decisions over time, live vs simulated TTFT/ITL p90) and ``timeline.png``.

    .venv/bin/python -m bench.planner.planner_live --replay bench/results/planner/live_calibrated \
        bench/results/planner/live_calibrated_10rps [--write]

replays recorded static runs through the simulator (no cluster: the calibration phase's
recorded p90s, the traces rebuilt from the recorded arguments, ``--profile``), prints the error
table and, with ``--write``, stores the simulator's side of each ``live.json`` again.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvrelay.deploy.planner.calibrate import Calibration, calibrate
from kvrelay.deploy.planner.planner import Planner
from kvrelay.deploy.planner.profile import Profile
from kvrelay.deploy.planner.signals import ScalingPolicy
from kvrelay.deploy.planner.simulator import SimConfig, SimResult, simulate
from kvrelay.deploy.planner.trace import HASH_BLOCK, TraceRequest, generate, shapes

HERE = Path(__file__).resolve().parents[1]  # bench/
PAUSE_S = 3.0  # live: the trace's time zero comes 3 s after the calibration phase drained


def token_ids(r: TraceRequest, vocab: int = 4000) -> list[int]:
    out: list[int] = []
    for h in r.hash_ids:
        rng = random.Random(h)
        out += [rng.randrange(7, vocab) for _ in range(HASH_BLOCK)]
    return out[:r.prompt_len]


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else 0.0


def traces(a: dict[str, Any]) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """The run's trace and its calibration phase's (empty without one), from its arguments."""
    shape = shapes(a["peak_rate"], a["duration"], a["prompt"], a["output"])[a["shape"]]
    trace = generate(shape, seed=7, max_len=1800)
    # The steady shape runs at 0.6x its peak: ask for the peak that gives --calibrate-rate.
    cal_trace = generate(shapes(a["calibrate_rate"] / 0.6, a["calibrate_duration"], a["prompt"],
                                a["output"])["steady"], seed=8, max_len=1800) \
        if a["calibrate_rate"] > 0 else []
    return trace, cal_trace


def sim_config(a: dict[str, Any]) -> SimConfig:
    return SimConfig(a["ttft_slo_ms"], a["itl_slo_ms"], prefill=a["prefill"], decode=a["decode"],
                     interval_s=1.0, startup_s=a["startup"])


def _sim_side(res: SimResult, live: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    simd = {"ttft_p90_ms": res.ttft_p90_ms, "itl_p90_ms": res.itl_p90_ms,
            "attainment": res.attainment, "failed": res.failed}
    err = {k: (simd[k] - live[k]) / live[k] for k in ("ttft_p90_ms", "itl_p90_ms") if live[k]}
    return simd, err


def compare(a: dict[str, Any], profile: Profile, live: dict[str, Any],
            cal_p90s: tuple[float, float] | None,
            policy: Callable[[Profile], ScalingPolicy | None]) -> dict[str, Any]:
    """The simulator's side of ``live.json``: the calibration phase (if any) replayed first, as
    the cluster served it, then the trace, measured alone; the profile calibrated co-located
    (``sim``) and as if the pools had hardware of their own (``sim_separate``)."""
    cfg = sim_config(a)
    trace, cal_trace = traces(a)
    shift = cal_trace[-1].t + PAUSE_S if cal_trace else 0.0
    whole = cal_trace + [replace(r, t=round(r.t + shift, 4)) for r in trace]

    def run(p: Profile) -> SimResult:
        return simulate(p, whole, replace(cfg, measure_from_s=shift), policy(p))

    if cal_p90s is None:
        res = run(profile)
        simd, err = _sim_side(res, live)
        return {"sim": simd, "sim_rel_error": err, "calibration": None,
                "sim_timeline": _shifted(res.timeline, shift)}
    cals: dict[bool, Calibration] = {
        c: calibrate(profile, cal_trace, cfg, live_ttft_p90_ms=cal_p90s[0],
                     live_itl_p90_ms=cal_p90s[1], colocated=c) for c in (True, False)}
    res, apart, raw = run(cals[True].apply(profile)), run(cals[False].apply(profile)), run(profile)
    simd, err = _sim_side(res, live)
    simd.update(uncorrected_ttft_p90_ms=raw.ttft_p90_ms, uncorrected_itl_p90_ms=raw.itl_p90_ms)
    sep, sep_err = _sim_side(apart, live)
    return {"sim": simd, "sim_rel_error": err, "calibration": vars(cals[True]),
            "sim_separate": sep, "sim_separate_rel_error": sep_err,
            "calibration_separate": vars(cals[False]),
            "sim_timeline": _shifted(res.timeline, shift)}


def _shifted(timeline: list[dict[str, Any]], shift: float) -> list[dict[str, Any]]:
    return [{**row, "t": row["t"] - shift} for row in timeline]


def replay_recorded(run_dir: str | Path, profile: Profile) -> dict[str, Any]:
    """A recorded static run with a calibration phase, its simulator side recomputed."""
    doc = json.loads((Path(run_dir) / "live.json").read_text())
    a, cal = doc["args"], doc["calibration"]
    if a["mode"] != "static" or not cal:
        raise ValueError(f"{run_dir}: only static runs with a calibration phase replay")
    doc.update(compare(a, profile, doc["live"], (cal["live_ttft_p90_ms"],
                                                 cal["live_itl_p90_ms"]), lambda p: None))
    return doc


def error_table(docs: dict[str, dict[str, Any]]) -> str:
    """Markdown: live vs simulated TTFT / ITL p90 per run, both calibrations."""
    def cell(sim: dict[str, Any], err: dict[str, float]) -> str:
        return (f"{sim['ttft_p90_ms']:.0f} / {sim['itl_p90_ms']:.1f} "
                f"({err['ttft_p90_ms']:+.0%} / {err['itl_p90_ms']:+.0%})")

    lines = ["| run | rate (req/s) | live TTFT / ITL p90 (ms) | separate hardware: fit | sim "
             "(error) | co-located: fit | sim (error) |", "|---|---|---|---|---|---|---|"]
    for name, d in docs.items():
        live, cs, cc = d["live"], d["calibration_separate"], d["calibration"]
        rate = live["requests"] / d["args"]["duration"]
        lines.append(" | ".join([
            f"| {name}", f"{rate:.1f}", f"{live['ttft_p90_ms']:.0f} / {live['itl_p90_ms']:.1f}",
            f"engine x{cs['engine_scale']:.2f}, +{cs['extra_ttft_s'] * 1000:.0f} ms",
            cell(d["sim_separate"], d["sim_separate_rel_error"]),
            f"engine x{cc['engine_scale']:.2f}, k {cc['contention']:.2f}",
            cell(d["sim"], d["sim_rel_error"])]) + " |")
    return "\n".join(lines)


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
    ap.add_argument("--replay", nargs="+", metavar="RUN_DIR",
                    help="no cluster: replay these recorded runs through the simulator")
    ap.add_argument("--write", action="store_true",
                    help="with --replay: store the recomputed simulator side in each live.json")
    a = ap.parse_args()
    if a.replay:
        docs = {Path(d).name: replay_recorded(d, Profile.load(a.profile)) for d in a.replay}
        print(error_table(docs))
        if a.write:
            for d, doc in zip(a.replay, docs.values(), strict=True):
                (Path(d) / "live.json").write_text(json.dumps(doc, indent=1, default=str))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trace, cal_trace = traces(vars(a))

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
    live = {"ttft_p90_ms": p90([r["ttft_ms"] for r in ok]),
            "itl_p90_ms": p90([r["itl_ms"] for r in ok if r["output"] > 1]),
            "attainment": met / len(rows), "failed": len(rows) - len(ok), "requests": len(rows)}
    cal_p90s = None
    if cal_rows:
        cal_ok = [r for r in cal_rows if r["ok"]]
        cal_p90s = (p90([r["ttft_ms"] for r in cal_ok]),
                    p90([r["itl_ms"] for r in cal_ok if r["output"] > 1]))

    def policy(p: Profile) -> ScalingPolicy | None:
        return Planner(p, spec.planner.config) if spec.planner is not None else None

    sim = compare(vars(a), Profile.load(a.profile), live, cal_p90s, policy)
    for d in decisions:
        d["t_run"] = d["t"] - wall0
    for c in counts:
        c["t"] -= mono0
    doc = {"args": vars(a), "live": live, **sim, "counts": counts, "decisions": decisions,
           "requests": rows, "calibration_requests": cal_rows}
    (out / "live.json").write_text(json.dumps(doc, indent=1, default=str))
    shown = ("live", "sim", "sim_rel_error", "calibration", "sim_separate",
             "sim_separate_rel_error", "calibration_separate")
    print(json.dumps({k: doc[k] for k in shown if k in doc}, indent=1))
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
