"""The Grafana dashboard is what its script writes and only queries metrics kvrelay exports."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvrelay.deploy.planner.metrics import PlannerMetrics
from kvrelay.deploy.planner.signals import PlanDecision
from kvrelay.engine.cpu.prefetch_tuner import PrefetchChoices
from kvrelay.engine.engine_core import EngineStats
from kvrelay.engine.step_cost import StepCostFit
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.registry import WorkerRegistry
from kvrelay.worker.metrics import WorkerMetrics

GRAFANA = Path(__file__).resolve().parent.parent / "deploy" / "grafana"


def _script():
    spec = importlib.util.spec_from_file_location("make_dashboard", GRAFANA / "make_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exported() -> dict[str, set[str]]:
    """Sample names kvrelay exposes (router and worker /metrics) -> their label names."""
    router = RouterMetrics(WorkerRegistry(), "demo")
    stats = EngineStats(**{n: {} if str(f.type).startswith("dict") else 1
                          for n, f in EngineStats.__dataclass_fields__.items()})
    stats = dataclasses.replace(stats, step_cost=StepCostFit(1e-3, 1e-5, 1e-9, 1e-4, 1e-7, 32),
                                kv_transfer={"held": 1, "hold_ended_notice": 1},
                                gemm_prefetch=PrefetchChoices({8: True}, 3))
    worker = WorkerMetrics(lambda: stats, "decode", "decode-0")
    planner = CollectorRegistry()  # the planner's series, on the router's registry or its own
    PlannerMetrics(planner).record(
        PlanDecision(2, 1, "test", {"required_prefill": 2.0, "ttft_margin": 0.1,
                                    "itl_margin": 0.2, "load_period_s": 100.0}),
        {"prefill": 1, "decode": 1})
    out: dict[str, set[str]] = {}
    for reg in (router.registry, worker.registry, planner):
        for fam in reg.collect():
            types = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",)}
            for suffix in ("", *types.get(fam.type, ())):
                out.setdefault(fam.name + suffix, set())
            for s in fam.samples:
                out.setdefault(s.name, set()).update(s.labels)
    # Labeled histograms/counters without observations expose no samples: add their labels.
    out["kvrelay:request_success_total"].add("finished_reason")
    out["kvrelay:router_decisions_total"].update({"decision", "reason"})
    out["kvrelay:engine_step_seconds_bucket"].update({"pool", "le"})
    return out


def test_committed_dashboard_is_fresh() -> None:
    assert (GRAFANA / "kvrelay.json").read_text() == _script().render(), \
        "run: python deploy/grafana/make_dashboard.py"


def test_every_queried_metric_and_label_exists() -> None:
    exported = _exported()
    dash = json.loads((GRAFANA / "kvrelay.json").read_text())
    queried = 0
    for panel in dash["panels"]:
        for t in panel["targets"]:
            for name in re.findall(r"kvrelay:[a-z0-9_]+", t["expr"]):
                queried += 1
                assert name in exported, f"{panel['title']}: {name} is not exported"
            for grp in re.findall(r"by \(([^)]*)\)", t["expr"]):
                labels = {x.strip() for x in grp.split(",")} - {"le"}
                names = re.findall(r"kvrelay:[a-z0-9_]+", t["expr"])
                assert any(labels <= exported[n] | {"pool", "worker", "model_name"}
                           for n in names), f"{panel['title']}: labels {labels}"
    assert queried >= 20
