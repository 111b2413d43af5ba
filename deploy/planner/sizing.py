"""Replicas per pool that meet the SLOs at a load, from the profile and an observed correction.

Prefill: a pool of ``n`` replicas is an M/M/n queue whose service rate is a busy replica's
request throughput on prompts of the load's effective length (prompt tokens not found in a
prefix cache) and whose lone service time is that prompt's prefill. TTFT p90 is the p90
service time (prompt lengths vary: ``P90_PROMPT`` x the mean) plus the p90 wait from Erlang C,
``P(W > t) = C exp(-(n mu - lambda) t)``, plus the KV handoff.

Decode: by Little's law a replica holds ``B = lambda/n * output * itl(B)`` sequences; with
``itl(B) = a + k B`` that is ``B = lambda/n * out * a / (1 - lambda/n * out * k)``. Its ITL p90
(of the requests' mean ITL) is taken at ``B + 1.28 sqrt(B)`` (the batch's Poisson spread), and
the batch's KV must fit.

``corr`` multiplies the profile's times: the planner fits it to what it observes, so a profile
measured on other hardware, or a changed load mix, is corrected at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrelay.deploy.planner.profile import Profile

P90_PROMPT = 1.5  # p90 / mean of a prompt length (log-normal with sigma 0.4: 1.55)
Z90 = 1.2816
KV_FILL = 0.9  # of a decode replica's KV the sizing lets a batch take
MAX_UTILIZATION = 0.92  # of a prefill pool's throughput: beyond it, bursts queue for seconds


@dataclass(frozen=True)
class Load:
    rate: float  # requests/s
    prompt_len: float  # mean
    output_len: float  # mean
    cache_hit: float = 0.0  # fraction of prompt tokens found cached
    backlog_tokens: float = 0.0  # prompt tokens queued now, to drain within ``drain_s``
    drain_s: float = 10.0


def erlang_c(n: int, a: float) -> float:
    """Probability that an arrival waits in M/M/n with offered load ``a`` (< n)."""
    if a <= 0:
        return 0.0
    term, total = 1.0, 1.0
    for k in range(1, n):
        term *= a / k
        total += term
    last = term * a / n * n / (n - a)
    return last / (total + last)


def prefill_ttft_p90_s(profile: Profile, load: Load, n: int, corr: float = 1.0) -> float:
    """Predicted TTFT p90 with ``n`` prefill replicas (inf when they cannot keep up)."""
    if n <= 0:
        return math.inf
    eff = max(1.0, load.prompt_len * (1.0 - load.cache_hit))
    lone = profile.prefill_s(math.ceil(eff * P90_PROMPT))
    if load.rate <= 0:
        return corr * lone + profile.transfer_s
    tps = profile.prefill_tokens_per_s(math.ceil(eff))
    # A correction below 1 (the replica answers faster than profiled) shortens latencies but
    # never raises the throughput the pool is sized by above the profile's.
    mu = tps / eff / max(1.0, corr)  # requests/s per replica
    lam = load.rate + load.backlog_tokens / eff / max(load.drain_s, 1e-3)
    if lam >= MAX_UTILIZATION * n * mu:
        return math.inf
    rho = lam / (n * mu)
    # A busy replica batches: a request waits out the step in flight (half of one, on average)
    # and rides a step that grows from its lone prefill towards a full budget as load rises.
    full = profile.max_num_batched_tokens / tps
    service = corr * (lone + rho * max(0.0, full - profile.prefill_s(math.ceil(eff)))
                      + rho * full / 2) + profile.transfer_s
    c = erlang_c(n, lam / mu)
    wait = math.log(c / 0.1) / (n * mu - lam) if c > 0.1 else 0.0
    return service + wait


def decode_batch(profile: Profile, load: Load, n: int, corr: float = 1.0) -> float:
    """Mean sequences per decode replica (inf when the pool cannot keep up)."""
    if n <= 0:
        return math.inf
    ctx = load.prompt_len + load.output_len / 2
    a, b, c = profile.decode_coef
    a, k = corr * a, corr * (b + c * ctx)
    x = load.rate / n * max(load.output_len - 1, 0.0)  # sequence-seconds per second / itl
    if x * k >= 1:
        return math.inf
    return x * a / (1 - x * k)


def decode_itl_p90_s(profile: Profile, load: Load, n: int, corr: float = 1.0) -> float:
    bsz = decode_batch(profile, load, n, corr)
    if math.isinf(bsz):
        return math.inf
    ctx = load.prompt_len + load.output_len / 2
    hi = bsz + Z90 * math.sqrt(bsz)
    if hi * (load.prompt_len + load.output_len) > KV_FILL * profile.kv_capacity_tokens:
        return math.inf  # the batch does not fit: requests would wait for KV
    return corr * profile.itl_s(max(1.0, hi), ctx)


def required(profile: Profile, load: Load, ttft_s: float, itl_s: float, max_n: int,
             corr_prefill: float = 1.0, corr_decode: float = 1.0) -> tuple[int, int]:
    """Fewest replicas per pool (at most ``max_n``) that meet the targets at ``load``."""
    p = next((n for n in range(1, max_n + 1)
              if prefill_ttft_p90_s(profile, load, n, corr_prefill) <= ttft_s), max_n)
    d = next((n for n in range(1, max_n + 1)
              if decode_itl_p90_s(profile, load, n, corr_decode) <= itl_s), max_n)
    return p, d


def fit_correction(predict: callable, observed: float, lo: float = 0.25,
                   hi: float = 8.0) -> float:
    """The factor ``k`` with ``predict(k) == observed`` (``predict`` increasing in ``k``),
    by bisection on a log scale, clamped to ``[lo, hi]``."""
    if predict(lo) >= observed:
        return lo
    if predict(hi) <= observed:
        return hi
    a, b = math.log(lo), math.log(hi)
    for _ in range(30):
        m = (a + b) / 2
        if predict(math.exp(m)) < observed:
            a = m
        else:
            b = m
    return math.exp((a + b) / 2)
