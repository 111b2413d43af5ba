"""The serving report's profiler (bench/serving/proc_profile.py): CPU per process and thread
from /proc, py-spy's collapsed stacks read into own time per function, and a live busy process
profiled."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from bench.serving.proc_profile import ProcessProfiler, frame_key, read_collapsed
from bench.serving.serving_procs import Deployment, Proc

ROOT = Path(__file__).resolve().parents[1]

BUSY = """\
import sys, time

def spin(deadline):
    x = 0
    while time.monotonic() < deadline:
        x += 1
    return x

open(sys.argv[1], "w").close()
end = time.monotonic() + 60
while time.monotonic() < end:
    spin(time.monotonic() + 0.1)
"""


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_collapsed_stacks_give_each_leaf_function_its_own_samples(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    root = str(ROOT)
    raw.write_text(
        f"<module> (run.py:1);step ({root}/engine/engine_core.py:10);"
        "linear (/v/lib/python3.11/site-packages/torch/nn/functional.py:5) 30\n"
        f"<module> (run.py:1);step ({root}/engine/engine_core.py:12) 10\n"
        "select (/usr/lib/python3.11/selectors.py:468) 5\n"
        "garbage line\n")
    own = read_collapsed(raw)
    assert own == {"linear (torch/nn/functional.py)": 30, "step (engine/engine_core.py)": 10,
                   "select (selectors.py)": 5}
    assert frame_key("f (x.py:3)") == "f (x.py)" and frame_key("f") == "f"


def test_a_busy_process_is_charged_its_core_and_its_hot_function(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    dep = Deployment("busy")
    dep.spawn(Proc("spinner", [sys.executable, "-c", BUSY, str(ready)], {},
                   tmp_path / "spinner.log"))
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        pid = dep.procs[0].popen.pid
        prof = ProcessProfiler(dep, tmp_path, rate_hz=50)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        prof.start()
        time.sleep(2.0)
        doc = prof.stop()
        measured = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    finally:
        dep.stop()
    (p,) = doc["processes"]
    assert p["label"] == "spinner" and p["threads"] >= 1
    # One spinning thread: the share of a core it got, which on a shared host is what the
    # others leave it (0.26 once under a load average of 27), as /proc says around the window.
    assert measured > 0.02, "the spinner never ran"
    assert 0.5 * measured < p["cores"] < 1.5 * measured + 0.05, (p["cores"], measured)
    assert p["top_threads"][0]["name"].endswith("(main)")
    assert doc["client"]["cpu_s"] >= 0
    if not doc["py_spy"]:
        pytest.skip("py-spy is not installed (the bench extra)")
    log = (tmp_path / f"pyspy-{p['pid']}.log").read_text(errors="replace")
    if not p["samples"] and ("ermission" in log or "ptrace" in log.lower()):
        pytest.skip(f"py-spy may not attach here: {log.strip()[-200:]}")
    assert p["samples"] > 20, log
    assert p["top_functions"][0][0].startswith("spin ("), p["top_functions"]
    assert p["top_functions"][0][1] > 0.5
