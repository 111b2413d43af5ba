"""For every target the serving report misses, where the time goes: that target's run again on
each side (kvrelay's configuration and its reference), every process profiled.

    .venv/bin/python -m bench.serving.profile_missed bench/results     # then: \\
        bench/serving/report.py bench/results

``bench/serving/run_serving.py`` runs it after the measured runs (``--no-profile`` skips it). It
reads the results directory (its ``manifest.json`` settings, the runs' documents), evaluates the
targets, and for each configuration and run a missed target reads, starts the configuration
afresh, warms it up, and repeats the run under ``bench.serving.proc_profile.ProcessProfiler``: the
CPU of every process and thread, a py-spy profile of each Python process, kvrelay's engine steps.
A goodput target's run is the uniform workload at the reference's goodput rate (the load the
reference serves within the SLOs). Each profile is written to ``<config>/profile-<run>.json``;
``profile_section`` renders them for REPORT.md. Profiled runs are separate from the measured
ones (the sampler costs a few percent of a core per process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from bench.serving import loadgen
from bench.serving.proc_profile import ProcessProfiler, profile_markdown
from bench.serving.report_results import LABEL, Results, fmt, get, load_results
from bench.serving.report_targets import evaluate_targets
from bench.serving.serving_configs import SERVED_NAME, Settings, run_plans, start_config
from bench.serving.workloads import read_vocab
from kvrelay.engine.step_log import ENV as STEP_LOG_ENV

logger = logging.getLogger("bench.serving.run_serving")


def settings_from_manifest(results_dir: Path) -> Settings:
    raw = json.loads((results_dir / "manifest.json").read_text())["settings"]
    known = {f.name for f in fields(Settings)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known}
    return Settings(**kw)


def missed(res: Results) -> list[dict[str, Any]]:
    return [t for t in evaluate_targets(res) if t["verdict"] == "FAIL"]


def wanted(res: Results) -> list[tuple[str, str]]:
    """(configuration, run) pairs the missed targets read, in order, each once."""
    out: list[tuple[str, str]] = []
    for t in missed(res):
        for c in t["configs"]:
            if (c, t["run"]) not in out:
                out.append((c, t["run"]))
    return out


def plan_for(run: str, config: str, st: Settings, res: Results) -> loadgen.RunPlan:
    if run != "goodput":
        return run_plans(st)[run]
    # the reference's goodput rate: of the missed goodput target naming this configuration
    t = next(t for t in missed(res) if t["run"] == "goodput" and config in t["configs"])
    rate = get(res.doc("goodput", t["configs"][1]), "goodput.goodput_rps") or st.rate
    n = max(st.goodput_min_requests, int(rate * st.goodput_duration_s))
    return loadgen.RunPlan("uniform", n, rate, seed=st.seed, tag="goodput-profile",
                           timeout_s=st.request_timeout_s, slo_ttft_ms=st.slo_ttft_ms,
                           slo_tpot_ms=st.slo_tpot_ms)


def profile_one(config: str, run: str, st: Settings, res: Results) -> dict[str, Any]:
    plan = plan_for(run, config, st, res)
    workdir = Path(st.results_dir) / config / "logs-profile"
    workdir.mkdir(parents=True, exist_ok=True)
    for f in workdir.iterdir():
        f.unlink()
    step_log = str(workdir / "steps")
    old = os.environ.get(STEP_LOG_ENV)
    os.environ[STEP_LOG_ENV] = step_log  # the workers inherit it (vLLM ignores it)
    dep = None
    try:
        dep = start_config(config, st, workdir)
        vocab = read_vocab(st.model_dir)
        asyncio.run(loadgen.warmup(dep.base_url, SERVED_NAME, vocab, seed=st.seed))
        time.sleep(2.0)
        prof = ProcessProfiler(dep, workdir,
                               step_log=step_log if config.startswith("kvrelay") else None)
        prof.start()
        doc = asyncio.run(loadgen.benchmark_run(dep.base_url, SERVED_NAME, vocab, plan,
                                                keep_requests=False))
        profile = prof.stop()
    finally:
        if old is None:
            os.environ.pop(STEP_LOG_ENV, None)
        else:
            os.environ[STEP_LOG_ENV] = old
        if dep is not None:
            dep.stop()
    return {"config": config, "run": run, "plan": {"workload": plan.workload,
                                                  "num_requests": plan.num_requests,
                                                  "rate": str(plan.rate)},
            "summary": doc["summary"], "profile": profile}


def profile_missed(results_dir: Path) -> list[Path]:
    res = load_results(results_dir)
    st = settings_from_manifest(results_dir)
    st.results_dir = str(results_dir)
    written = []
    for config, run in wanted(res):
        logger.info("[%s] profiling the %s run (a missed target reads it)", config, run)
        try:
            doc = profile_one(config, run, st, res)
        except Exception as e:  # one side failing to start leaves the others' profiles
            logger.error("[%s] profile of %s failed: %s", config, run, e)
            continue
        path = Path(results_dir) / config / f"profile-{run}.json"
        path.write_text(json.dumps(doc, indent=1))
        written.append(path)
    return written


def profile_section(res: Results) -> str | None:
    """REPORT.md's "where the time goes": the missed targets and their runs' profiles."""
    targets = missed(res)
    if not targets:
        return None
    out = ["## Where the time goes (missed targets)", "",
           "Each missed target's run again, on a fresh deployment of each side, every process "
           "profiled (`bench.serving.profile_missed`, `bench.serving.proc_profile`): separate "
           "from the "
           "measured runs above, and slower than them (py-spy samples on the same two cores; "
           "each title gives that run's own latencies). Read the shares, not the totals.", ""]
    for t in targets:
        pairs = ", ".join(f"`{c}/{t['run']}`" for c in t["configs"])
        out.append(f"- {t['target']}: {fmt(t['ours'])} against {fmt(t['peer'])} "
                   f"(ratio {fmt(t['ratio'])}, want {t['want']}); profiles: {pairs}")
    missing = []
    for config, run in wanted(res):
        path = res.root / config / f"profile-{run}.json"
        if not path.exists():
            missing.append(f"`{config}/{run}`")
            continue
        doc = json.loads(path.read_text())
        s = doc["summary"]
        title = (f"{LABEL.get(config, config)}, `{run}` run ({doc['plan']['num_requests']} "
                 f"requests at {doc['plan']['rate']} req/s; this run: TTFT p99 "
                 f"{fmt(get(s, 'ttft_ms.p99'))} ms, TPOT p99 {fmt(get(s, 'tpot_ms.p99'))} ms, "
                 f"{fmt(s.get('output_throughput'))} tok/s)")
        out += ["", profile_markdown(title, doc["profile"])]
    if missing:
        out += ["", f"Not profiled: {', '.join(missing)} (`bench/serving/profile_missed.py "
                f"{res.root}`)."]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", type=Path)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for p in profile_missed(a.results_dir.resolve()):
        logger.info("wrote %s", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
