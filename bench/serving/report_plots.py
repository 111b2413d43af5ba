"""The report's plots (matplotlib, optional): latency CDFs, goodput against the offered rate,
and short requests' inter-token gaps around a long prompt's arrival.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serving.report_results import LABEL, RUN_TITLES, Results, fmt, get

logger = logging.getLogger("bench.serving.report")  # the report's: its log lines read as before


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
