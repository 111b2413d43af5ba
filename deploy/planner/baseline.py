"""Today's threshold autoscaler (``deploy/autoscaler.py``) behind the planner's policy interface,
so the simulator and the benchmark run its very decision code: one ``PoolAutoscaler`` per pool,
fed the same ``PoolSample`` the Ray controller builds, a pool with a change in flight skipped
(as the controller skips it), its cooldown restarted when a change finishes."""

from __future__ import annotations

from kvrelay.deploy.autoscaler import AutoscaleConfig, PoolAutoscaler, PoolSample
from kvrelay.deploy.planner.signals import POOLS, Observation, PlanDecision


class ThresholdPolicy:
    def __init__(self, config: AutoscaleConfig):
        self.scalers = {p: PoolAutoscaler(p, config) for p in POOLS}

    @staticmethod
    def sample(pool: str, obs: Observation) -> PoolSample:
        if pool == "prefill":
            return PoolSample(replicas=obs.prefill_replicas,
                              queued_prompt_tokens=obs.queued_prompt_tokens,
                              ttft_ms=obs.ttft_p90_ms, itl_ms=obs.itl_p90_ms)
        return PoolSample(replicas=obs.decode_replicas, kv_usage=obs.kv_usage,
                          running=obs.decode_running, ttft_ms=obs.ttft_p90_ms,
                          itl_ms=obs.itl_p90_ms)

    def decide(self, obs: Observation) -> PlanDecision:
        out, why = {}, []
        for pool, scaler in self.scalers.items():
            n = obs.replicas(pool)
            if pool in obs.changing:
                out[pool] = n
                continue
            d = scaler.decide(self.sample(pool, obs), obs.t)
            out[pool] = n + d.delta
            why.append(f"{pool}: {d.reason}")
        return PlanDecision(out["prefill"], out["decode"], "; ".join(why), {})

    def change_done(self, pool: str, t: float) -> None:
        self.scalers[pool].changed(t)
