"""The KV memory hierarchy below an engine's KV pool: blocks leaving the pool are demoted to a
host tier (and from there to a disk tier), not dropped, and promoted back on a prefix hit.

``media`` names the tiers: ``device`` (the engine's KV pool: GPU memory, or DRAM on a CPU
worker), ``host`` (``--kv-offload-memory``) and ``disk`` (``--kv-offload-dir``).
"""
