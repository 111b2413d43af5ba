"""A worker's own Prometheus metrics, served on ``--metrics-port`` (``/metrics``).

Gauges are read from the engine's latest stats at scrape time; names match the router's pool
gauges (``pool`` and ``worker`` labels) so an HPA can scale each pool on its own pods' metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvrelay.engine.engine_core import EngineStats
from kvrelay.engine.step_cost import FEATURES as STEP_COST_TERMS

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                5.12, 10.24)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], pool: str, worker: str):
        self.stats = stats
        self.labels = [pool, worker]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        names = ["pool", "worker"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self.labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(self.labels, value)
            return c

        yield gauge("kvrelay:kv_cache_usage_perc", "Fraction of KV blocks in use", s.kv_usage)
        yield gauge("kvrelay:num_requests_running", "Requests in the batch", s.num_running)
        yield gauge("kvrelay:num_requests_waiting", "Requests queued (incl. waiting for KV)",
                    s.num_waiting + s.num_waiting_for_kv)
        yield gauge("kvrelay:num_queued_prompt_tokens", "Prompt tokens queued for prefill",
                    s.waiting_prompt_tokens)
        yield gauge("kvrelay:num_requests_sending_kv", "Finished prefills still sending KV",
                    s.num_sending)
        yield counter("kvrelay:prefix_cache_queries", "Prompt tokens looked up",
                      s.prefix_cache_queries)
        yield counter("kvrelay:prefix_cache_hits", "Prompt tokens found", s.prefix_cache_hits)
        yield counter("kvrelay:num_preemptions", "Sequences preempted (recompute)",
                      s.num_preemptions)
        yield gauge("kvrelay:prefill_token_budget",
                    "Prefill tokens the latest step with decodes could carry (TPOT target, "
                    "ITL cap)", s.prefill_budget)
        yield counter("kvrelay:tpot_capped_steps",
                      "Steps whose prefill tokens the TPOT target or ITL cap capped",
                      s.num_capped_steps)
        yield counter("kvrelay:itl_cap_yielded_steps",
                      "Steps with decodes in which the ITL cap yielded: the oldest queued "
                      "prompt had waited --itl-cap-max-queue-ms", s.num_cap_yields)
        if s.kv_transfer:
            held = GaugeMetricFamily("kvrelay:kv_blocks_held_requests",
                                     "Aborted receivers whose blocks wait for their sender",
                                     labels=names)
            held.add_metric(self.labels, s.kv_transfer.get("held", 0))
            yield held
            ev = CounterMetricFamily("kvrelay:kv_transfer_events",
                                     "KV transfer events: holds ended (fenced/notice/sender "
                                     "gone/backstop), notifications from a foreign agent",
                                     labels=[*names, "event"])
            for k, v in sorted(s.kv_transfer.items()):
                if k != "held":
                    ev.add_metric([*self.labels, k], v)
            yield ev
        if s.kv_tiers:
            yield from self._tiers(s)
        if s.prefix_shares:  # prefix pulls: blocks lent to peers' reads, read from peers
            shares = CounterMetricFamily(
                "kvrelay:prefix_pull_blocks", "Prefix pulls: KV blocks lent to a peer's read "
                "(exported), read from a peer and published (imported), and pulls dropped "
                "unpublished (failed_imports: the prompt was recomputed)",
                labels=[*names, "event"])
            for k, v in sorted(s.prefix_shares.items()):
                shares.add_metric([*self.labels, k], v)
            yield shares
        if s.step_cost is not None:
            fam = GaugeMetricFamily(
                "kvrelay:step_cost_seconds",
                "Online fit of engine step time: seconds per unit of each term (base per step, "
                "per prefill token, per attended query-key pair, per decode, per decode "
                "context token, per prefill chunk)", labels=[*names, "term"])
            for term in STEP_COST_TERMS:
                fam.add_metric([*self.labels, term], getattr(s.step_cost, term))
            yield fam
        if s.gemm_prefetch is not None:
            fam = GaugeMetricFamily(
                "kvrelay:gemm_next_panel_prefetch",
                "Whether the panel GEMM prefetches its next panel in decode steps of this many "
                "rows (1) or not (0), as its online probes last measured faster",
                labels=[*names, "rows"])
            for rows, on in s.gemm_prefetch.choices.items():
                fam.add_metric([*self.labels, str(rows)], int(on))
            yield fam
            yield counter("kvrelay:gemm_prefetch_probes", "Probes of the next-panel prefetch "
                          "(paired on/off decode steps) that have ended", s.gemm_prefetch.probes)

    def _tiers(self, s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The tiers below the KV pool (host, disk), one series each (``tier`` label)."""
        names = ["pool", "worker", "tier"]
        fams: list[GaugeMetricFamily | CounterMetricFamily] = []

        def family(kind: type, name: str, doc: str, attr: str) -> None:
            fam = kind(name, doc, labels=names)
            for medium, t in sorted(s.kv_tiers.items()):
                fam.add_metric([*self.labels, medium], float(getattr(t, attr)))
            fams.append(fam)

        family(GaugeMetricFamily, "kvrelay:kv_tier_capacity_blocks",
               "KV blocks a tier below the pool can hold", "capacity_blocks")
        family(GaugeMetricFamily, "kvrelay:kv_tier_used_blocks",
               "KV blocks a tier below the pool holds (stored or in flight)", "used_blocks")
        usage = GaugeMetricFamily("kvrelay:kv_tier_usage_perc",
                                  "Fraction of a tier's blocks in use", labels=names)
        for medium, t in sorted(s.kv_tiers.items()):
            usage.add_metric([*self.labels, medium],
                             t.used_blocks / t.capacity_blocks if t.capacity_blocks else 0.0)
        fams.append(usage)
        family(CounterMetricFamily, "kvrelay:kv_tier_stored_blocks",
               "KV blocks written into a tier", "stored_blocks")
        family(CounterMetricFamily, "kvrelay:kv_tier_stored_bytes",
               "KV bytes written into a tier", "stored_bytes")
        family(CounterMetricFamily, "kvrelay:kv_tier_hit_blocks",
               "KV blocks loaded from a tier for a prefix hit", "hit_blocks")
        family(CounterMetricFamily, "kvrelay:kv_tier_loaded_bytes",
               "KV bytes loaded from a tier", "loaded_bytes")
        family(CounterMetricFamily, "kvrelay:kv_tier_load_seconds",
               "Seconds spent loading KV blocks from a tier (over kv_tier_hit_blocks: the "
               "mean load latency of a block)", "load_seconds")
        family(GaugeMetricFamily, "kvrelay:kv_tier_load_seconds_per_block",
               "Mean seconds one block's load from a tier took, since start",
               "load_seconds_per_block")
        family(CounterMetricFamily, "kvrelay:kv_tier_load_failures",
               "Loads from a tier that failed verification (the request recomputed them)",
               "load_failures")
        family(CounterMetricFamily, "kvrelay:kv_tier_evicted_blocks",
               "KV blocks dropped from a tier (or moved down from it)", "evicted_blocks")
        yield from fams


class WorkerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], pool: str, worker: str,
                 attention: str = "", device: str = ""):
        self.registry = CollectorRegistry()
        if attention:  # what this engine attends with: alert on a GPU worker's "sdpa"
            Gauge("kvrelay:attention_backend_info", "1 for the attention backend the engine "
                  "runs (flash, sdpa or native) on its device kind", ["pool", "worker", "backend",
                                                                      "device"],
                  registry=self.registry).labels(pool, worker, attention, device).set(1)
        self.step_time = Histogram("kvrelay:engine_step_seconds", "Engine step duration",
                                   ["pool", "worker"], buckets=STEP_BUCKETS,
                                   registry=self.registry).labels(pool, worker)
        self.registry.register(_EngineCollector(stats, pool, worker))
        self.engine_stuck = Gauge("kvrelay:engine_stuck", "1 while an engine step has run past "
                                  "the watchdog's limit (readiness is off)", ["pool", "worker"],
                                  registry=self.registry).labels(pool, worker)
        self.engine_stalls = Counter("kvrelay:engine_stalls", "Engine steps that ran past the "
                                     "watchdog's limit", ["pool", "worker"],
                                     registry=self.registry).labels(pool, worker)
        self._server: object | None = None

    def serve(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
