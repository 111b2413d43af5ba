"""Write deploy/grafana/kvrelay.json, the Grafana dashboard for kvrelay's Prometheus metrics.

    python deploy/grafana/make_dashboard.py

The JSON is committed; tests/test_deploy_grafana.py checks it is what this script writes and that
every metric it queries is one kvrelay exports. Import it in Grafana (Dashboards -> Import) and
pick the Prometheus data source that scrapes the router and the workers.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("kvrelay.json")


def q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend, "datasource": {"uid": "${datasource}"}}


def quantiles(metric: str, by: str = "") -> list[dict]:
    extra = f", {by}" if by else ""
    suffix = " {{" + by + "}}" if by else ""
    return [q(f"histogram_quantile({p}, sum by (le{extra}) "
              f"(rate({metric}_bucket[$__rate_interval])))", f"p{int(p * 100)}{suffix}")
            for p in (0.5, 0.9, 0.99)]


PANELS: list[tuple[str, str, list[dict]]] = [
    # (title, unit, targets)
    ("Time to first token", "s", quantiles("kvrelay:time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("kvrelay:inter_token_latency_seconds")),
    ("Time per output token", "s", quantiles("kvrelay:time_per_output_token_seconds")),
    ("End-to-end latency", "s", quantiles("kvrelay:e2e_request_latency_seconds")),
    ("Queue time (router -> first schedule)", "s",
     quantiles("kvrelay:request_queue_time_seconds")),
    ("Prefill time", "s", quantiles("kvrelay:request_prefill_time_seconds")),
    ("KV transfer time", "s", quantiles("kvrelay:kv_transfer_time_seconds")),
    ("KV transfer bandwidth", "Bps",
     [q("sum(rate(kvrelay:kv_transfer_bytes_total[$__rate_interval]))", "bytes/s")]),
    ("KV transfer failures", "short",
     [q("sum(increase(kvrelay:kv_transfer_failures_total[$__rate_interval]))", "failures")]),
    ("Requests: finished by reason / failed", "reqps",
     [q("sum by (finished_reason) (rate(kvrelay:request_success_total[$__rate_interval]))",
        "{{finished_reason}}"),
      q("sum(rate(kvrelay:request_failures_total[$__rate_interval]))", "failed")]),
    ("Tokens / s", "short",
     [q("sum(rate(kvrelay:generation_tokens_total[$__rate_interval]))", "generated"),
      q("sum(rate(kvrelay:prompt_tokens_total[$__rate_interval]))", "prompt"),
      q("sum(rate(kvrelay:cached_prompt_tokens_total[$__rate_interval]))", "prompt (cached)")]),
    ("Requests running / waiting per worker", "short",
     [q("kvrelay:num_requests_running", "running {{worker}}"),
      q("kvrelay:num_requests_waiting", "waiting {{worker}}"),
      q("kvrelay:router_requests_in_flight", "in router")]),
    ("KV cache usage per worker", "percentunit",
     [q("kvrelay:kv_cache_usage_perc", "{{pool}} {{worker}}")]),
    ("Queued prompt tokens (prefill pool)", "short",
     [q('kvrelay:num_queued_prompt_tokens{pool="prefill"}', "{{worker}}")]),
    ("Prefix cache hit rate", "percentunit",
     [q("sum by (pool) (rate(kvrelay:prefix_cache_hits_total[$__rate_interval])) / "
        "clamp_min(sum by (pool) (rate(kvrelay:prefix_cache_queries_total[$__rate_interval])), 1)",
        "{{pool}}")]),
    ("Routing decisions", "short",
     [q("sum by (decision) (rate(kvrelay:router_decisions_total[$__rate_interval]))",
        "{{decision}}")]),
    ("Migrations and preemptions", "short",
     [q("sum(increase(kvrelay:request_migrations_total[$__rate_interval]))", "migrations"),
      q("sum(increase(kvrelay:num_preemptions_total[$__rate_interval]))", "preemptions")]),
    ("Engine step time", "s", quantiles("kvrelay:engine_step_seconds", "pool")),
    ("Live workers per pool", "short", [q("kvrelay:workers", "{{pool}}")]),
    # The SLO planner (`--planner`; on the router's /metrics, or the `kvrelay planner` process's)
    ("Planner: replicas per pool", "short",
     [q("kvrelay:planner_current_replicas", "current {{pool}}"),
      q("kvrelay:planner_desired_replicas", "desired {{pool}}"),
      q("kvrelay:planner_required_replicas", "required {{pool}}")]),
    ("Planner: request rate and the load's period", "short",
     [q("kvrelay:planner_request_rate", "{{kind}} req/s"),
      q("kvrelay:planner_load_period_seconds", "period (s)")]),
    ("Planner: SLO margin and profile correction", "short",
     [q("kvrelay:planner_slo_margin", "margin {{slo}}"),
      q("kvrelay:planner_profile_correction", "correction {{pool}}")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        for ref, t in zip("ABCDEFGH", targets, strict=False):
            t["refId"] = ref
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": targets,
        })
    return {
        "title": "kvrelay", "uid": "kvrelay-overview", "schemaVersion": 39, "version": 1,
        "tags": ["kvrelay", "llm"], "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
