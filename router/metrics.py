"""Prometheus metrics of the router, named in the vLLM style under ``kvrelay:``.

Request-level metrics are observed as requests finish. Pool gauges (KV usage, running,
waiting, prefix-cache counters) are read from the workers' latest heartbeats at scrape time,
with ``pool`` and ``worker`` labels, so the router's /metrics shows the whole cluster. So are
the routing counters (prompt tokens each worker computed or found cached, KV blocks sent or
skipped) and the routing cost model's measured parameters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.engine.step_cost_fit import FEATURES as STEP_COST_TERMS
from kvrelay.engine.tiers.media import DEVICE
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.registry import tier_usage as tier_usage_of

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BYTES_BUCKETS = tuple(2.0 ** k for k in range(10, 34, 2))


class _PoolCollector(Collector):
    def __init__(self, registry: WorkerRegistry):
        self.registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["pool", "worker"]
        usage = GaugeMetricFamily("kvrelay:kv_cache_usage_perc",
                                  "Fraction of KV blocks in use (last heartbeat)", labels=labels)
        running = GaugeMetricFamily("kvrelay:num_requests_running",
                                    "Requests in a worker's batch", labels=labels)
        waiting = GaugeMetricFamily("kvrelay:num_requests_waiting",
                                    "Requests queued on a worker (incl. waiting for KV)",
                                    labels=labels)
        queued = GaugeMetricFamily("kvrelay:num_queued_prompt_tokens",
                                   "Prompt tokens queued for prefill", labels=labels)
        queries = CounterMetricFamily("kvrelay:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache",
                                      labels=labels)
        hits = CounterMetricFamily("kvrelay:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", labels=labels)
        workers = GaugeMetricFamily("kvrelay:workers", "Live workers per pool", labels=["pool"])
        tier_usage = GaugeMetricFamily(
            "kvrelay:kv_tier_usage_perc", "Fraction of the blocks of a tier below the KV pool "
            "(host, disk) in use (last heartbeat; the pool's is kv_cache_usage_perc)",
            labels=[*labels, "tier"])
        tier_weight = GaugeMetricFamily(
            "kvrelay:router_tier_weight", "What a prefix block held in a tier is worth to the "
            "routing cost model, as a fraction of one held in the KV pool (fitted from the "
            "worker's measured load cost once it has one)", labels=[*labels, "tier"])
        per_pool: dict[str, int] = {"prefill": 0, "decode": 0, "both": 0}
        for w in self.registry.workers.values():
            role = w.identity.role
            lv = [role, w.worker_id]
            ld = w.reported.load
            per_pool[role] = per_pool.get(role, 0) + 1
            usage.add_metric(lv, 1.0 - ld.free_blocks / ld.num_blocks if ld.num_blocks else 0.0)
            running.add_metric(lv, ld.running)
            waiting.add_metric(lv, ld.waiting + ld.waiting_for_kv)
            queued.add_metric(lv, ld.queued_prompt_tokens)
            queries.add_metric(lv, ld.prefix_cache_queries)
            hits.add_metric(lv, ld.prefix_cache_hits)
            for medium, t in tier_usage_of(ld).items():
                if medium != DEVICE:
                    tier_usage.add_metric([*lv, medium], t["usage"])
            if ld.tiers:
                for medium, weight in sorted(w.reported.tier_weights.items()):
                    tier_weight.add_metric([*lv, medium], weight)
        for pool, n in per_pool.items():
            workers.add_metric([pool], n)
        yield from (usage, running, waiting, queued, queries, hits, workers, tier_usage,
                    tier_weight)
        yield from self._routing()

    def _routing(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["pool", "worker"]
        routed = CounterMetricFamily(
            "kvrelay:router_prompt_tokens_routed",
            "Prompt tokens of requests the router had a worker prefill (prefill pool) or run "
            "wholly (decode pool: fast lane)", labels=labels)
        computed = CounterMetricFamily(
            "kvrelay:router_prompt_tokens_computed",
            "Of those, the tokens the worker computed (the rest were in its prefix cache)",
            labels=labels)
        sent = CounterMetricFamily("kvrelay:router_kv_blocks_sent",
                                   "KV blocks written into a decode worker", labels=labels)
        skipped = CounterMetricFamily(
            "kvrelay:router_kv_blocks_skipped",
            "Prompt KV blocks not sent: the decode worker held them already", labels=labels)
        credited = CounterMetricFamily(
            "kvrelay:router_prefix_tokens_credited",
            "Prompt tokens the chosen worker held when the router routed a request to it, by "
            "the tier each block was credited from (device: the KV pool; host, disk: below it, "
            "credited at the tier's weight)", labels=[*labels, "tier"])
        for (pool, worker), c in sorted(self.registry.counters.items()):
            lv = [pool, worker]
            if c.prompt_tokens:
                routed.add_metric(lv, c.prompt_tokens)
                computed.add_metric(lv, c.computed_tokens)
            if c.kv_blocks_sent or c.kv_blocks_skipped:
                sent.add_metric(lv, c.kv_blocks_sent)
                skipped.add_metric(lv, c.kv_blocks_skipped)
            for medium, tokens in sorted(c.credited_tokens.items()):
                credited.add_metric([*lv, medium], tokens)
        model = GaugeMetricFamily(
            "kvrelay:router_cost_model",
            "Measured parameters of the routing cost model (seconds, bytes)",
            labels=["param", "pool", "worker"])
        perf = self.registry.perf
        a, b = perf.transfer.coef()
        model.add_metric(["transfer_fixed_seconds", "", ""], a)
        model.add_metric(["transfer_bytes_per_second", "", ""], 2.0**20 / b if b > 0 else 0.0)
        model.add_metric(["transfer_samples", "", ""], perf.transfer.n)
        model.add_metric(["prefill_rpc_overhead_seconds", "", ""], perf.prefill_rpc_s.value)
        if perf.block_bytes:
            model.add_metric(["kv_block_bytes", "", ""], perf.block_bytes)
        a, b = perf.pull.coef()
        model.add_metric(["pull_fixed_seconds", "", ""], a)
        model.add_metric(["pull_bytes_per_second", "", ""], 2.0**20 / b if b > 0 else 0.0)
        model.add_metric(["pull_samples", "", ""], perf.pull.n)
        pulls = self._pulls(perf.pull_crossover_tokens)
        for w in self.registry.workers.values():
            role, perf = w.identity.role, w.perf
            lv = [role, w.worker_id]
            fit = perf.step_cost  # its engine's own (engine/step_cost_fit.py), as last beaten
            if fit is not None:
                for term in STEP_COST_TERMS:
                    model.add_metric([f"step_{term}_seconds", *lv], getattr(fit, term))
                model.add_metric(["step_samples", *lv], fit.samples)
            if role != "prefill":
                model.add_metric(["reserve_rpc_seconds", *lv], perf.reserve_rpc_s.value)
        yield from (routed, computed, sent, skipped, credited, model, *pulls)

    def _pulls(self, crossover: int | None) -> list[GaugeMetricFamily | CounterMetricFamily]:
        """Prefix pulls (``router/prefix_pull.py``): decisions, outcomes, what they brought."""
        c = self.registry.pulls
        decisions = CounterMetricFamily(
            "kvrelay:router_pull_decisions", "Prefill requests for which another worker held "
            "more of the prompt's prefix than the chosen prefill worker, by what the cost model "
            "decided (pull it over NIXL, or recompute it) and the pool holding it",
            labels=["decision", "source_pool"])
        for (decision, pool), n in sorted(c.decisions.items()):
            decisions.add_metric([decision, pool], n)
        outcomes = CounterMetricFamily(
            "kvrelay:router_pull_outcomes", "Pulls by how they ended (PullOutcome): PULL_DONE, "
            "or why the prefill worker fell back to recomputing", labels=["outcome"])
        for name, n in sorted(c.outcomes.items()):
            outcomes.add_metric([name], n)
        fallbacks = CounterMetricFamily(
            "kvrelay:router_pull_fallbacks", "Pulls that failed and were recomputed instead "
            "(holder unreachable or dead, read failed or timed out, export lapsed, no room)")
        fallbacks.add_metric([], c.fallbacks)
        tokens = CounterMetricFamily("kvrelay:router_pulled_tokens",
                                     "Prompt tokens pulled from another worker, not computed")
        tokens.add_metric([], c.pulled_tokens)
        nbytes = CounterMetricFamily("kvrelay:router_pulled_bytes",
                                     "KV bytes prefill workers read from other workers")
        nbytes.add_metric([], c.pulled_bytes)
        out: list[GaugeMetricFamily | CounterMetricFamily] = [decisions, outcomes, fallbacks,
                                                               tokens, nbytes]
        if crossover is not None:
            g = GaugeMetricFamily(
                "kvrelay:router_pull_crossover_tokens", "The prefix length above which the "
                "cost model predicts pulling it faster than recomputing it (measured pulls and "
                "the prefill pool's step-time fit)")
            g.add_metric([], crossover)
            out.append(g)
        return out


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, model_name: str):
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model = model_name
        self.ttft = Histogram("kvrelay:time_to_first_token_seconds", "Time to first token",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvrelay:inter_token_latency_seconds",
                             "Gap between consecutive streamed tokens", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvrelay:time_per_output_token_seconds",
                              "(e2e - ttft) / (output tokens - 1) per request", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvrelay:e2e_request_latency_seconds", "End-to-end latency", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvrelay:request_queue_time_seconds",
                               "Receipt until the prefill was scheduled", m,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("kvrelay:request_prefill_time_seconds",
                                 "Prefill compute time", m, buckets=LATENCY_BUCKETS, registry=r)
        self.transfer = Histogram("kvrelay:kv_transfer_time_seconds",
                                  "KV delivery after the last prefill compute", m,
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_bytes = Counter("kvrelay:kv_transfer_bytes", "KV bytes written P -> D", m,
                                      registry=r)
        self.transfer_failures = Counter("kvrelay:kv_transfer_failures",
                                         "Prefill/transfer attempts that failed", m, registry=r)
        self.migrations = Counter("kvrelay:request_migrations",
                                  "Streams resumed on another worker", m, registry=r)
        self.finished = Counter("kvrelay:request_success", "Finished requests", m +
                                ["finished_reason"], registry=r)
        self.failed = Counter("kvrelay:request_failures", "Requests that ended in an error",
                              m + ["code"], registry=r)
        self.prompt_tokens = Counter("kvrelay:prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter("kvrelay:generation_tokens", "Generated tokens", m,
                                         registry=r)
        self.cached_tokens = Counter("kvrelay:cached_prompt_tokens",
                                     "Prompt tokens served from a prefix cache", m, registry=r)
        self.in_flight = Gauge("kvrelay:router_requests_in_flight", "Requests in the router",
                               m, registry=r)
        self.decisions = Counter("kvrelay:router_decisions", "Routing decisions", m +
                                 ["decision", "reason"], registry=r)
        self.registry.register(_PoolCollector(workers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
