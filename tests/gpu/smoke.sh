#!/usr/bin/env bash
# The GPU smoke from a bare source tree (tests/gpu/README.md): no install, no network.
#
#   bash tests/gpu/smoke.sh [--only PHASE,...]      results in $OUT (or ./smoke-out)
#
# - Wheels in $KVRELAY_SMOKE_WHEELS (default: .whl/ at the repo root), if any, are unpacked into
#   a private folder first (tests/gpu/README.md says which to bring: the trimmed NIXL wheel).
# - A `kvrelay` package shim maps the repository's folders to their `kvrelay.*` names the way
#   pyproject.toml's package-dir does, so the tree imports without `pip install -e`.
# - flash_standin/ comes first on the path only where no flash-attn is installed.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="${KVRELAY_SMOKE_ROOT:-$(cd "$HERE/../.." && pwd)}"
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/smoke-out}"
export OUT
WORK="$(mktemp -d /tmp/kvr-smoke-XXXXXX)"
WHEELS="${KVRELAY_SMOKE_WHEELS:-$ROOT/.whl}"

EXTRA=""
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target \
        "$WORK/site" "$WHEELS"/*.whl || echo "smoke: installing $WHEELS failed" >&2
    EXTRA="$WORK/site"
fi

# The shim: kvrelay/ holds the kvrelay folder's own files and one link per mapped package.
"$PY" - "$ROOT" "$WORK/shim" <<'EOF'
import os, sys, tomllib
root, shim = sys.argv[1], sys.argv[2]
dirs = tomllib.load(open(os.path.join(root, "pyproject.toml"), "rb"))["tool"]["setuptools"][
    "package-dir"]
pkg = os.path.join(shim, "kvrelay")
os.makedirs(pkg)
for name in os.listdir(os.path.join(root, dirs["kvrelay"])):
    os.symlink(os.path.join(root, dirs["kvrelay"], name), os.path.join(pkg, name))
for name, folder in dirs.items():
    if name.count(".") == 1:
        os.symlink(os.path.join(root, folder), os.path.join(pkg, name.split(".")[1]))
EOF

PATHS="$WORK/shim:$HERE:$ROOT/tests"
[ -n "$EXTRA" ] && PATHS="$PATHS:$EXTRA"
if ! PYTHONPATH="$PATHS" "$PY" -c "import flash_attn" 2> /dev/null; then
    PATHS="$HERE/flash_standin:$PATHS"
fi
export PYTHONPATH="$PATHS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}" HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
"$PY" "$HERE/smoke.py" --out "$OUT" "$@"
rc=$?
rm -rf "$WORK"
exit $rc
