"""What the GPU machine offers, written out for the record of a first run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nixl_report() -> dict[str, Any]:
    """Which NIXL build loaded and what its UCX backend offers, from NIXL's own API: the wheel
    ships UCX's libraries but no ``ucx_info``. The ``nixl`` meta package dispatches to
    ``nixl_cu12`` or ``nixl_cu13`` by torch's CUDA major (the CUDA 12 image holds nixl-cu12
    alone). Runs on the CPU too (tests/test_gpu_readiness.py). Which transport a GPU transfer
    takes (cuda_ipc, cuda_copy, rc) is UCX's choice per transfer: test_transfer_gpu.py and the
    smoke's nixl_vram phase log it (``UCX_PROTO_INFO=y``)."""
    report: dict[str, Any] = {d: _version(d) for d in ("nixl", "nixl-cu12", "nixl-cu13")}
    try:
        import nixl._api as api
    except ImportError as e:
        return {**report, "error": f"import nixl: {e}"}
    build = api.__name__.split(".")[0]  # nixl._api is the loaded build's module
    agent = api.nixl_agent(f"kvrelay-env-{os.getpid()}",
                           api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    libs = Path(sys.modules[build].__file__).parent.parent / f"{build}.libs" / "ucx"
    return {
        **report, "build": build,
        "plugins": sorted(agent.get_plugin_list()),
        "ucx_plugin_params": dict(agent.get_plugin_params("UCX")),
        "ucx_plugin_mem_types": sorted(agent.get_plugin_mem_types("UCX")),
        # once the backend is up: what UCX found to register (VRAM_SEG needs its CUDA module)
        "ucx_backend_mem_types": sorted(agent.get_backend_mem_types("UCX"))
        if "UCX" in agent.backends else [],
        # UCX's transport (uct_*) and memory-hook (ucm_*) modules the wheel bundles: uct_cuda
        # and ucm_cuda for VRAM, uct_ib* for RDMA, uct_cma for host memory across processes
        "ucx_modules": sorted({p.name.split(".")[0].removeprefix("lib")
                               for p in libs.glob("lib*.so*")
                               if p.name.startswith(("libuct_", "libucm_"))}),
        "ucx_tls_env": os.environ.get("UCX_TLS"),
    }


def test_environment_report() -> None:
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    report = {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "flash_attn": _version("flash-attn"),
        "gpus": [{"name": p.name, "capability": f"{p.major}.{p.minor}",
                  "memory_gib": round(p.total_memory / 2**30, 1)} for p in props],
        "nixl": nixl_report(),
    }
    with open(os.environ.get("KVRELAY_GPU_REPORT", "gpu-report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    assert torch.version.cuda is not None and props
    nixl = report["nixl"]
    if nixl["nixl"]:  # the build matching torch's CUDA, with VRAM through UCX
        assert nixl.get("build") == f"nixl_cu{torch.version.cuda.split('.')[0]}", nixl
        assert "VRAM_SEG" in nixl["ucx_backend_mem_types"], nixl
    if report["flash_attn"]:
        import flash_attn  # noqa: F401 - an ABI mismatch with torch shows here first
