"""How many GPUs each Ray replica asks for, and the device its engine is then told to use.

Ray hides every GPU from an actor that asked for none (``CUDA_VISIBLE_DEVICES=""``), so on a GPU
node a replica with ``--device auto`` and no GPU request would run fp32 on the CPU without a
word. ``auto`` therefore looks at the cluster: GPUs there mean one per replica and ``--device
cuda`` (a worker that then sees none fails at start, see ``kvrelay.engine.device``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

logger = logging.getLogger(__name__)


class GpuRequest(NamedTuple):
    gpus_per_replica: float
    device: str  # what the replicas' engines are given


def gpu_request(device: str, explicit: float | None,
                cluster_resources: Mapping[str, float]) -> GpuRequest:
    """``explicit`` (``--gpus-per-replica``) wins; else ``cuda*`` asks for one GPU, ``cpu`` for
    none, and ``auto`` for one when the cluster has any GPU (the engine then gets ``cuda``)."""
    if explicit is not None:
        if explicit < 0:
            raise ValueError(f"--gpus-per-replica must be non-negative, got {explicit}")
        if device == "auto":
            device = "cuda" if explicit > 0 else "cpu"
        elif device.startswith("cuda") and explicit == 0:
            raise ValueError(f"--device {device} with --gpus-per-replica 0: Ray would hide "
                             "every GPU from the replicas")
        return GpuRequest(float(explicit), device)
    if device.startswith("cuda"):
        return GpuRequest(1.0, device)
    if device == "auto":
        gpus = float(cluster_resources.get("GPU", 0.0))
        if gpus > 0:
            logger.info("--device auto: the Ray cluster has %g GPU(s); one per replica, "
                        "engines on cuda", gpus)
            return GpuRequest(1.0, "cuda")
        return GpuRequest(0.0, "cpu")
    return GpuRequest(0.0, device)
