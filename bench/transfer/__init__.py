"""The KV transport: NIXL GB/s and cost per descriptor, the P->D hand-off's latency and
its overlap with prefill compute."""
