"""Summarize engine step logs (``KVRELAY_STEP_LOG``, ``kvrelay.engine.step_log``) by step kind.

    KVRELAY_STEP_LOG=/tmp/steps .venv/bin/python -m bench.serving.run_serving --configs \\
        kvrelay-agg \\
        --runs sat --no-report --results-dir /tmp/res
    KVRELAY_STEP_LOG=/tmp/offline .venv/bin/python -m bench.serving.offline --skip-vllm ...
    .venv/bin/python -m bench.serving.step_log /tmp/steps.* /tmp/offline.*

Each file is one engine's steps. A run is its busiest burst: steps no more than ``--gap``
seconds apart, the burst with the most prefill tokens (a benchmark's warm-up and its runs are
separate bursts). Per kind (steps with prefill tokens, decode-only steps) it prints the count,
total seconds, prefill tokens or mean decode rows, and ms per step: the same workload served and
offline has the same steps, so the ratio of their times is what serving costs the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from kvrelay.engine.step_log import StepRecord, read


def busiest_burst(steps: Sequence[StepRecord], gap: float) -> list[StepRecord]:
    bursts: list[list[StepRecord]] = []
    for s in steps:
        if bursts and s.start - (bursts[-1][-1].start + bursts[-1][-1].seconds) <= gap:
            bursts[-1].append(s)
        else:
            bursts.append([s])
    return max(bursts, key=lambda b: sum(s.prefill_tokens for s in b), default=[])


def summary(steps: Sequence[StepRecord]) -> str:
    if not steps:
        return "no steps"
    span = steps[-1].start + steps[-1].seconds - steps[0].start
    busy = sum(s.seconds for s in steps)
    pre = [s for s in steps if s.prefill_tokens]
    dec = [s for s in steps if not s.prefill_tokens and s.decodes]
    lines = [f"{len(steps)} steps over {span:.2f} s, {busy:.2f} s stepping"]
    if pre:
        t = sum(s.seconds for s in pre)
        lines.append(f"  with prefill: {len(pre):4d} steps {t:7.2f} s "
                     f"{sum(s.prefill_tokens for s in pre):7d} tokens "
                     f"{1e3 * t / len(pre):8.2f} ms/step")
    if dec:
        t = sum(s.seconds for s in dec)
        lines.append(f"  decode only:  {len(dec):4d} steps {t:7.2f} s "
                     f"{sum(s.decodes for s in dec) / len(dec):7.1f} rows   "
                     f"{1e3 * t / len(dec):8.2f} ms/step")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--gap", type=float, default=1.0,
                    help="seconds between steps that separate two bursts")
    args = ap.parse_args(argv)
    for path in args.logs:
        print(f"{path}: {summary(busiest_burst(read(path), args.gap))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
