"""Where a run's time goes: every process's CPU, a sampling profile of each Python process, and
kvrelay's engine steps.

``ProcessProfiler`` wraps one run of a started ``Deployment``:

* **CPU per process and thread**, from ``/proc`` (user + system seconds over the run), for every
  process the deployment started and their descendants (vLLM's engine core is a child of its API
  server), and for the load generator (the bench's own process, on the same two cores);
* **a sampling profile** of every Python process with py-spy (the ``bench`` extra): ``record
  --nonblocking`` (the target is never paused) at ``rate`` Hz, idle threads left out, so a
  function's share of a process's samples is its share of that process's on-CPU Python time.
  Threads with no Python frames (OpenMP workers, gRPC's C threads) show in the ``/proc`` CPU,
  not in the samples;
* **engine steps** (kvrelay only): the deployment's workers started with ``KVRELAY_STEP_LOG``
  (``kvrelay.engine.step_log``); the steps inside the run's window, by kind.

``stop()`` returns a JSON-able document; ``profile_markdown`` renders it for REPORT.md.
Linux only (``/proc``); without py-spy the CPU and steps are still recorded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.serving.serving_procs import ROOT, Deployment, process_tree, stat_cpu

logger = logging.getLogger("bench.serving.run_serving")
TOP_THREADS, TOP_FUNCTIONS = 3, 6


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds) of a process's threads."""
    out = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tids:
        s = stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        if s is not None:
            out[tid] = s
    return out


def is_python(pid: int) -> bool:
    try:
        return "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False


def frame_key(frame: str) -> str:
    """``func (path:line)`` -> ``func (short/path.py)``: the path from its package root."""
    name, _, loc = frame.partition(" (")
    path = loc.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        root = str(ROOT) + "/"
        if path.startswith(root):
            path = path[len(root):]
        elif "/lib/python" in path:
            path = path.split("/lib/python", 1)[1].split("/", 1)[-1]
    return f"{name} ({path})" if path else name


def read_collapsed(path: Path) -> Counter[str]:
    """Own samples per function of a py-spy ``--format raw`` file (collapsed stacks)."""
    own: Counter[str] = Counter()
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return own
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        own[frame_key(stack.rsplit(";", 1)[-1])] += int(count)
    return own


class ProcessProfiler:
    """Profile every process of ``dep`` (and the client) between ``start()`` and ``stop()``."""

    def __init__(self, dep: Deployment, workdir: Path, *, rate_hz: int = 100,
                 step_log: str | None = None) -> None:
        self.dep, self.workdir, self.rate_hz, self.step_log = dep, workdir, rate_hz, step_log
        self.py_spy = shutil.which("py-spy") or _venv_tool("py-spy")
        self._procs: list[dict[str, Any]] = []
        self._spies: list[tuple[subprocess.Popen[bytes], Path, dict[str, Any]]] = []
        self._t0 = self._wall0 = 0.0
        self._client0: tuple[str, float] | None = None

    def start(self) -> None:
        for proc in self.dep.procs:
            if proc.popen is None:
                continue
            root = proc.popen.pid
            for pid in process_tree([root]):
                threads = thread_cpu(pid)
                if not threads:
                    continue
                comm = threads.get(pid, ("?", 0.0))[0]
                label = proc.name if pid == root else f"{proc.name}/{comm}"
                self._procs.append({"label": label, "pid": pid, "cpu0": threads})
        if self.py_spy is None:
            logger.warning("py-spy not found (pip install py-spy): CPU only, no profiles")
        for p in self._procs:
            if self.py_spy is not None and is_python(p["pid"]):
                out = self.workdir / f"pyspy-{p['pid']}.txt"
                cmd = [self.py_spy, "record", "--pid", str(p["pid"]), "--rate",
                       str(self.rate_hz), "--format", "raw", "--nonblocking", "--output",
                       str(out)]
                log = open(self.workdir / f"pyspy-{p['pid']}.log", "wb")  # noqa: SIM115
                self._spies.append((subprocess.Popen(cmd, stdout=log, stderr=log), out, p))
                log.close()
        time.sleep(0.5)  # py-spy attaches
        self._client0 = stat_cpu("/proc/self/stat")
        self._t0, self._wall0 = time.monotonic(), time.time()

    def stop(self) -> dict[str, Any]:
        t1 = time.monotonic()
        wall = t1 - self._t0
        client1 = stat_cpu("/proc/self/stat")
        procs = [self._proc_doc(p, wall) for p in self._procs]
        for spy, _, _ in self._spies:
            with contextlib.suppress(ProcessLookupError):
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for spy, out, p in self._spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
            own = read_collapsed(out)
            n = sum(own.values())
            doc = next(d for d in procs if d["pid"] == p["pid"])
            doc["samples"] = n
            doc["sampled_cores"] = n / self.rate_hz / wall if wall > 0 else None
            doc["top_functions"] = [[k, v / n] for k, v in own.most_common(TOP_FUNCTIONS)] \
                if n else []
        client = None
        if self._client0 and client1:
            client = {"label": "client (load generator)", "pid": os.getpid(),
                      "cpu_s": client1[1] - self._client0[1]}
            client["cores"] = client["cpu_s"] / wall if wall > 0 else None
        return {"wall_s": wall, "rate_hz": self.rate_hz, "py_spy": self.py_spy is not None,
                "processes": procs, "client": client,
                "engines": self._engines(self._t0, t1)}

    def _proc_doc(self, p: dict[str, Any], wall: float) -> dict[str, Any]:
        now = thread_cpu(p["pid"])
        rows = []
        for tid, (comm, cpu) in now.items():
            rows.append({"tid": tid, "name": comm + (" (main)" if tid == p["pid"] else ""),
                         "cpu_s": cpu - p["cpu0"].get(tid, (comm, 0.0))[1]})
        rows.sort(key=lambda r: -r["cpu_s"])
        total = sum(r["cpu_s"] for r in rows)
        return {"label": p["label"], "pid": p["pid"], "cpu_s": total,
                "cores": total / wall if wall > 0 else None, "threads": len(rows),
                "top_threads": rows[:TOP_THREADS]}

    def _engines(self, t0: float, t1: float) -> list[dict[str, Any]]:
        if not self.step_log:
            return []
        from kvrelay.engine.step_log import read

        out = []
        for path in sorted(Path(self.step_log).parent.glob(Path(self.step_log).name + ".*")):
            steps = [s for s in read(path) if t0 <= s.start <= t1]
            pre = [s for s in steps if s.prefill_tokens]
            dec = [s for s in steps if not s.prefill_tokens and s.decodes]
            out.append({
                "pid": int(path.suffix[1:]), "steps": len(steps),
                "busy_s": sum(s.seconds for s in steps),
                "prefill_steps": len(pre), "prefill_s": sum(s.seconds for s in pre),
                "prefill_tokens": sum(s.prefill_tokens for s in pre),
                "decode_steps": len(dec), "decode_s": sum(s.seconds for s in dec),
                "decode_rows": sum(s.decodes for s in dec)})
        return out


def _venv_tool(name: str) -> str | None:
    p = Path(sys.executable).with_name(name)
    return str(p) if p.exists() else None


# -- markdown ------------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def profile_markdown(title: str, doc: dict[str, Any]) -> str:
    """One profiled run: a row per process (CPU, busiest threads, top functions), the engines'
    steps."""
    wall = doc["wall_s"]
    lines = [f"#### {title}", "",
             f"{wall:.1f} s of wall time; CPU in cores (1.0 = one core busy for the whole run)"
             + (f"; py-spy at {doc['rate_hz']} Hz: the share of a process's on-CPU Python "
                "samples by function (own time)" if doc.get("py_spy") else "; no py-spy"),
             "", "| process | CPU (cores) | busiest threads (cores) | Python sampled (cores) "
             "| top functions (own share) |", "|---|---|---|---|---|"]
    rows = list(doc["processes"])
    if doc.get("client"):
        rows.append({**doc["client"], "top_threads": [], "top_functions": []})
    for p in rows:
        threads = ", ".join(f"{t['name']} {t['cpu_s'] / wall:.2f}"
                            for t in p.get("top_threads", []) if t["cpu_s"] > 0.01 * wall)
        funcs = "<br>".join(f"{share:.0%} `{name}`" for name, share in p.get("top_functions", []))
        lines.append(f"| {p['label']} | {_f(p.get('cores'))} | {threads or '-'} | "
                     f"{_f(p.get('sampled_cores'))} | {funcs or '-'} |")
    for e in doc.get("engines", []):
        lines.append("")
        text = (f"Engine (pid {e['pid']}): {e['steps']} steps, {e['busy_s']:.1f} s stepping "
                f"({e['busy_s'] / wall:.0%} of the run)")
        if e["prefill_steps"]:
            text += (f"; {e['prefill_steps']} with prefill, {e['prefill_s']:.1f} s, "
                     f"{1e3 * e['prefill_s'] / e['prefill_steps']:.1f} ms/step, "
                     f"{e['prefill_tokens'] / e['prefill_steps']:.0f} tokens/step")
        if e["decode_steps"]:
            text += (f"; {e['decode_steps']} decode-only, {e['decode_s']:.1f} s, "
                     f"{1e3 * e['decode_s'] / e['decode_steps']:.1f} ms/step, "
                     f"{e['decode_rows'] / e['decode_steps']:.1f} rows/step")
        lines.append(text + ".")
    return "\n".join(lines)
