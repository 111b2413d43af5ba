#!/usr/bin/env bash
# The wheels the GPU smoke brings to a bare GPU machine (tests/gpu/README.md), into .whl/ at the
# repository root (keep .whl/ out of git: `echo /.whl/ >> .git/info/exclude`).
#
#   bash tests/gpu/prepare_wheels.sh [PYTHON_VERSION=3.12] [CUDA_MAJOR=13]
#
# NIXL: the CUDA build matching the machine's torch (cu13 for torch +cu130), trimmed from 59 MB
# to 14 MB (trim_wheel.py), and the `nixl` meta package that provides `import nixl`, which would
# otherwise pull both CUDA builds.
set -euo pipefail
PYV="${1:-3.12}"
CUDA="${2:-13}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$ROOT/.whl"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp "${PLAT[@]}" -d "$TMP" "nixl-cu${CUDA}==1.5.1"
python3 -m pip download -q --no-deps -d "$DEST" "nixl==1.5.1"
python3 "$ROOT/tests/gpu/trim_wheel.py" "$TMP"/nixl_cu"${CUDA}"-*.whl "$DEST"
ls -la "$DEST"
