"""Write the planner benchmark's load traces (Mooncake JSONL) into a folder.

    .venv/bin/python -m bench.planner.make_traces --peak-rate 120 --duration 600 --out bench/traces

Five shapes (``kvrelay.deploy.planner.trace.shapes``): steady (0.6 x peak), ramp (low -> peak ->
low), diurnal-like (two cosine "days"), bursty (20 s bursts of 2.5 x the base every 100 s) and a
long-prompt shift (prompts 3 x longer from the middle on). Seeded: the same flags write the same
files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrelay.deploy.planner.trace import generate, save, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peak-rate", type=float, default=120.0, help="requests/s at the peak")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds per trace")
    ap.add_argument("--prompt", type=float, default=512, help="mean prompt tokens")
    ap.add_argument("--output", type=float, default=64, help="mean output tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/traces")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, shape in shapes(a.peak_rate, a.duration, a.prompt, a.output).items():
        trace = generate(shape, seed=a.seed)
        save(out / f"{name}.jsonl", trace)
        print(f"{out / (name + '.jsonl')}: {len(trace)} requests")


if __name__ == "__main__":
    main()
