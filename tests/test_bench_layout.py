"""bench/ is a package of suites with one runner: no module edits sys.path, every benchmark is
listed by ``python -m bench``, and the results git keeps are the reports a reader needs (under
2 MB). (File-level import circles, bench/ included, are tests/test_import_graph.py's.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_LIMIT = 2 * 2**20


def test_no_bench_module_edits_sys_path() -> None:
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("sys.path."):
                raise AssertionError(f"{path.relative_to(ROOT)} edits sys.path")


def test_the_runner_lists_every_suite_and_runs_a_benchmark() -> None:
    out = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for suite in ("serving/", "engine/", "transfer/", "planner/", "routing/", "soak/"):
        assert suite in out.splitlines(), out
    assert "run_serving" in out and "throughput" in out and "kv_transfer" in out
    helped = subprocess.run([sys.executable, "-m", "bench", "serving", "loadgen", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert "--base-url" in helped.stdout


def test_tracked_results_fit_in_two_mib() -> None:
    files = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    assert files, "bench/results keeps its reports"
    total = sum((ROOT / f).stat().st_size for f in files if (ROOT / f).exists())
    assert total <= RESULTS_LIMIT, f"bench/results in git: {total / 2**20:.2f} MiB"
    assert not [f for f in files if f.endswith(".jsonl")], "raw JSONL stays out of git"
