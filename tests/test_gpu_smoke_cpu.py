"""The GPU smoke's CPU mode, as a bare GPU machine would start it: ``tests/gpu/smoke.sh`` from
the tree (its ``kvrelay`` shim, not the installed package), no CUDA. The CPU-checkable phases
run and pass; the CUDA phases say they were skipped and why; ``smoke.json`` is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "tests" / "gpu" / "smoke.sh"


@pytest.mark.slow
def test_smoke_cpu_mode(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="",
               KVRELAY_SMOKE_WHEELS=str(tmp_path / "no-wheels"))
    run = subprocess.run(
        ["bash", str(SMOKE), "--only", "environment,standin_vs_reference,cuda_graphs",
         "--budget", "240"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert report["environment"]["status"] == "INFO"
    assert report["environment"]["cuda_available"] is False
    assert report["environment"]["flash_attn_standin"] is True  # no flash-attn here
    assert report["standin_vs_reference"]["status"] == "PASS"
    assert report["standin_vs_reference"]["max_abs_err"] < 1e-3
    assert report["cuda_graphs"] == {**report["cuda_graphs"], "status": "SKIP",
                                     "why": "no CUDA device visible to torch"}
    lines = run.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:3]] == ["INFO", "PASS", "SKIP"]
    assert (tmp_path / "smoke-environment.log").exists()


def test_smoke_shim_imports_the_tree_not_the_installed_package(tmp_path: Path) -> None:
    """The shim maps every package-dir of pyproject.toml: a module imported through it is the
    tree's file."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = (
        'PY=python3; ROOT="$1"; WORK="$2"\n'
        + SMOKE.read_text().split("# The shim:", 1)[1].split("PATHS=", 1)[0]
        .split("\n", 1)[1]
    )
    subprocess.run(["bash", "-c", script.replace("python3", sys.executable), "_", str(ROOT),
                    str(tmp_path)], check=True, env=env, timeout=60)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    pkg = tmp_path / "shim" / "kvrelay"
    for name, folder in dirs.items():
        if name.count(".") == 1:
            assert (pkg / name.split(".")[1]).resolve() == ROOT / folder, name
    # -S: no site-packages, so no installed (editable) kvrelay can answer instead of the shim;
    # and not from the repository root, whose kvrelay/ folder would
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import kvrelay.common as c; print(c.__path__[0])"],
        env={**env, "PYTHONPATH": str(tmp_path / "shim")}, cwd=tmp_path, capture_output=True,
        text=True, check=True, timeout=60).stdout.strip()
    assert out == str(pkg / "common") and Path(out).resolve() == ROOT / "common"
