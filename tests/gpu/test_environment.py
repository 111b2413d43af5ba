"""What the GPU machine offers, written out for the record of a first run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess

import torch


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ucx_transports() -> list[str]:
    if not shutil.which("ucx_info"):
        return []
    out = subprocess.run(["ucx_info", "-d"], capture_output=True, text=True, timeout=60).stdout
    return sorted({line.split(":", 1)[1].strip() for line in out.splitlines()
                   if line.strip().startswith("# Transport:")})


def test_environment_report() -> None:
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    report = {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "flash_attn": _version("flash-attn"), "nixl": _version("nixl"),
        "gpus": [{"name": p.name, "capability": f"{p.major}.{p.minor}",
                  "memory_gib": round(p.total_memory / 2**30, 1)} for p in props],
        "ucx_transports": _ucx_transports(),
        "ucx_tls_env": os.environ.get("UCX_TLS"),
    }
    with open(os.environ.get("KVRELAY_GPU_REPORT", "gpu-report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    assert torch.version.cuda is not None and props
    if report["flash_attn"]:
        import flash_attn  # noqa: F401 - an ABI mismatch with torch shows here first
