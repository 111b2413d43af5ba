"""The planner's decisions as Prometheus series (``kvrelay:planner_*``), on any registry: the
router's (Ray: the controller hands each decision to the router actor, so the router's /metrics
shows it beside the load it was made from) or the Kubernetes planner process's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvrelay.deploy.planner.signals import POOLS, PlanDecision


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.desired = Gauge("kvrelay:planner_desired_replicas",
                             "Replicas the planner wants per pool (after steps and budget)",
                             ["pool"], registry=r)
        self.current = Gauge("kvrelay:planner_current_replicas",
                             "Replicas per pool when the planner decided", ["pool"], registry=r)
        self.required = Gauge("kvrelay:planner_required_replicas",
                              "Replicas the sizing says meet the SLOs at the predicted load",
                              ["pool"], registry=r)
        self.rate = Gauge("kvrelay:planner_request_rate",
                          "Request rate: observed over the last interval, and planned for",
                          ["kind"], registry=r)
        self.margin = Gauge("kvrelay:planner_slo_margin",
                            "1 - predicted p90 / SLO with the desired replicas (negative: miss)",
                            ["slo"], registry=r)
        self.correction = Gauge("kvrelay:planner_profile_correction",
                                "Observed / profiled time factor per pool", ["pool"],
                                registry=r)
        self.period = Gauge("kvrelay:planner_load_period_seconds",
                            "Period of the request rate's repeating pattern (0: none found)",
                            registry=r)
        self.decisions = Counter("kvrelay:planner_decisions",
                                 "Planner decisions by pool and action", ["pool", "action"],
                                 registry=r)

    def record(self, d: PlanDecision, current: dict[str, int]) -> None:
        x = d.details
        for pool in POOLS:
            cur, want = current.get(pool, 0), d.target(pool)
            self.desired.labels(pool).set(want)
            self.current.labels(pool).set(cur)
            self.required.labels(pool).set(x.get(f"required_{pool}", want))
            self.correction.labels(pool).set(x.get(f"correction_{pool}", 1.0))
            action = "up" if want > cur else "down" if want < cur else "hold"
            self.decisions.labels(pool, action).inc()
        self.rate.labels("observed").set(x.get("observed_rate", 0.0))
        self.rate.labels("predicted").set(x.get("predicted_rate", 0.0))
        self.period.set(x.get("load_period_s", 0.0))
        for slo in ("ttft", "itl"):
            v = x.get(f"{slo}_margin")
            if v is not None:
                self.margin.labels(slo).set(max(-10.0, v))
