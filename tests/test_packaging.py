"""The repository's shape stays whole: committed stubs are fresh, every package is installed under
``kvrelay.``, and nothing of ours is importable under a bare top-level name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def test_committed_protobuf_stubs_are_not_stale() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "proto" / "run_codegen.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"stale stubs: run `make proto`\n{r.stdout}{r.stderr}"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_directory_is_listed_in_pyproject() -> None:
    cfg = _pyproject()["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            if any(part.startswith(".") or part == "__pycache__" for part in init.parts):
                continue
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    # Sub-packages of a mapped package that have their own mapping are listed once.
    assert found <= listed, f"packages missing from pyproject: {sorted(found - listed)}"
    assert listed <= found, f"pyproject lists packages that do not exist: {sorted(listed - found)}"


def test_design_card_folders_import_under_kvrelay() -> None:
    import importlib

    for name in ("engine", "kv_transfer", "prefill_worker", "decode_worker", "router", "proto",
                 "deploy"):
        mod = importlib.import_module(f"kvrelay.{name}")
        assert Path(mod.__file__).resolve().parent == ROOT / name


def test_console_script_and_cli_entry_point() -> None:
    assert _pyproject()["project"]["scripts"]["kvrelay"] == "kvrelay.cli:main"
    r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0
    for sub in ("serve", "router", "worker", "generate", "scale", "status", "demo-model"):
        assert sub in r.stdout


def test_torch_is_pinned_to_a_cpu_build_in_constraints() -> None:
    pins = dict(line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"].startswith("2.13.0")


def test_process_flags_default_to_the_settings_dataclasses() -> None:
    """A flag left out gives what the dataclass gives: one set of defaults, not two."""
    from kvrelay.cli import build_parser, router_settings_from_args, worker_settings_from_args
    from kvrelay.router.server import RouterSettings
    from kvrelay.worker.settings import WorkerSettings

    parser = build_parser()
    router = router_settings_from_args(parser.parse_args(["router", "--model", "m"]))
    assert router == RouterSettings(model="m", http_port=None)
    for role in ("prefill", "decode", "both"):
        worker = worker_settings_from_args(
            parser.parse_args(["worker", "--role", role, "--model", "m"]))
        assert worker == WorkerSettings(role=role)
    worker = worker_settings_from_args(parser.parse_args(
        ["worker", "--role", "prefill", "--model", "m", "--kv-layerwise", "off"]))
    assert worker.kv_layerwise == "off"
    with pytest.raises(ValueError, match="kv_layerwise"):
        WorkerSettings(role="prefill", kv_layerwise="sometimes")
