"""The KV hand-off's timing contract, torch-free (the worker's flags validate against it).

A decode worker reuses the blocks it promised to a prefill worker once no router has listed that
worker for the *sender grace*; the prefill worker stops posting writes the *self-fence horizon*
after a router last listed it (``kv_transfer.self_fence``), and a posted write fails after the
*write timeout*. No write can land after the grace as long as horizon + write timeout < grace.
"""

from __future__ import annotations

# The KV hand-off's timing contract (``self_fence``): a receiver reuses blocks promised to a
# sender no router listed for KV_SENDER_GRACE_S; the sender stops posting KV_SELF_FENCE_S after
# a router last listed it, and a posted write fails after KV_WRITE_TIMEOUT_S: 5 + 4 < 10.
KV_SENDER_GRACE_S = 10.0
KV_SELF_FENCE_S = 5.0
KV_WRITE_TIMEOUT_S = 4.0


def kv_timing_defaults(grace_s: float | None) -> tuple[float, float, float]:
    """(grace, self-fence horizon, write timeout) with the defaults for a given grace: at most
    the defaults above, scaled down with a shorter grace (half and 0.4 of it)."""
    g = KV_SENDER_GRACE_S if grace_s is None else grace_s
    return g, min(KV_SELF_FENCE_S, 0.5 * g), min(KV_WRITE_TIMEOUT_S, 0.4 * g)


def check_kv_timing(grace_s: float, write_timeout_s: float, self_fence_s: float | None) -> None:
    """A write must never land after the receiver's grace: the sender's last post (its
    self-fence horizon after its last proof) plus the longest a write stays in flight (the write
    timeout) must end strictly before the grace can run out. ValueError naming the flags."""
    if self_fence_s is None:
        return
    if not self_fence_s > 0:
        raise ValueError(f"--kv-self-fence must be positive, got {self_fence_s}")
    if not self_fence_s + write_timeout_s < grace_s:
        raise ValueError(
            f"--kv-self-fence ({self_fence_s:g} s) + --kv-write-timeout ({write_timeout_s:g} s) "
            f"must be shorter than --kv-sender-grace ({grace_s:g} s): a prefill worker cut off "
            f"from the routers could otherwise still write into blocks its decode worker has "
            f"given to another request")
