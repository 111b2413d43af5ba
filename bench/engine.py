"""Engine throughput beside the machine's ceilings and beside transformers, measured in one run.

    .venv/bin/python bench/engine.py [--model DIR] [--threads 2] [--reps 3]

With no ``--model`` it writes the ~150M-parameter demo Llama (``kvrelay demo-model --size base``)
to a temporary directory. Everything runs fp32 on CPU with ``--threads`` intra-op threads.

Ceilings, measured first:
  - matmul: fp32 GFLOP/s of ``torch.mm`` on the model's own projection shapes at M = 2048 rows;
  - memory: bandwidth of ``Tensor.copy_`` over a buffer as large as the weights, counted as bytes
    read + bytes written per second (the traffic a copy makes).

Prefill: one prompt of 128 / 512 / 2048 tokens, time to its first token. GFLOP/s counts the
decoder layers' matmuls (2 x params x tokens), the LM head at the last position and causal
attention (2 x 2 x tokens^2 / 2 x heads x head_dim x layers); ratio = GFLOP/s / matmul ceiling.

Decode: B requests (32-token prompts) stepping together; tokens/s = B / step time. The ceiling of
one step is reading every weight once (weight bytes / memory bandwidth); ratio = that time /
measured step time. transformers: the same checkpoint, ``model(ids)`` for prefill and
``generate`` (greedy, KV cache) for decode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams

PREFILL_LENS = (128, 512, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_PROMPT = 32
DECODE_STEPS = 24


def best(fn: Callable[[], float], reps: int) -> float:
    """The fastest of ``reps`` timings (the least disturbed by a shared machine)."""
    return min(fn() for _ in range(reps))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- ceilings ----------------------------------------------------------------------------------
def matmul_ceiling(hidden: int, inter: int, reps: int) -> float:
    m = 2048
    a = torch.randn(m, hidden)
    shapes = [(hidden, inter), (inter, hidden), (hidden, hidden)]
    ws = [torch.randn(k, n) for k, n in shapes]
    out = [torch.empty(m, n) for _, n in shapes]
    xs = [a, torch.randn(m, inter), a]
    for x, w, o in zip(xs, ws, out, strict=True):
        torch.mm(x, w, out=o)  # warm-up
    flops = sum(2 * m * k * n for k, n in shapes)

    def run() -> float:
        return timed(lambda: [torch.mm(x, w, out=o) for x, w, o in zip(xs, ws, out, strict=True)])

    return flops / best(run, reps + 2) / 1e9


def copy_bandwidth(nbytes: int, reps: int) -> float:
    n = nbytes // 4
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    return 2 * nbytes / best(lambda: timed(lambda: dst.copy_(src)), reps + 2) / 1e9


def checkpoint_params(model_dir: str) -> int:
    """Parameters in the checkpoint's safetensors files (the engine may repack its copies)."""
    from glob import glob

    from safetensors import safe_open

    n = 0
    for path in glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                n += _prod(f.get_slice(k).get_shape())
    return n


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


# -- kvrelay -----------------------------------------------------------------------------------
def make_core(model: str, threads: int, num_blocks: int) -> EngineCore:
    cfg = EngineConfig.from_kwargs(model, num_threads=threads, num_blocks=num_blocks,
                                   max_num_batched_tokens=2048, max_num_seqs=64,
                                   enable_prefix_caching=False)
    return EngineCore(cfg, eos_token_ids=frozenset())


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (n,), generator=g).tolist()


def ours_prefill(core: EngineCore, n: int, reps: int, vocab: int) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    seeds = iter(range(10_000))

    def run() -> float:
        rid = f"p{next(seeds)}"
        core.add_request(rid, prompt(n, next(seeds), vocab), sp)
        t = time.perf_counter()
        while core.has_unfinished():
            core.step()
        return time.perf_counter() - t

    run()
    return best(run, reps)


def ours_decode_step(core: EngineCore, batch: int, reps: int, vocab: int) -> float:
    sp = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0, ignore_eos=True)
    seeds = iter(range(20_000, 40_000))

    def run() -> float:
        for i in range(batch):
            core.add_request(f"d{next(seeds)}-{i}", prompt(DECODE_PROMPT, next(seeds), vocab), sp)
        for _ in range(3):  # prefill + first decode steps, not counted
            core.step()
        times = []
        while core.has_unfinished():
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[:-1] or times)

    return best(run, reps)


# -- transformers ------------------------------------------------------------------------------
def hf_prefill(model: torch.nn.Module, n: int, reps: int, vocab: int) -> float:
    ids = torch.tensor([prompt(n, 7, vocab)])

    def run() -> float:
        with torch.inference_mode():
            return timed(lambda: model(ids, use_cache=False))

    run()
    return best(run, reps)


def hf_decode_step(model: torch.nn.Module, batch: int, reps: int, vocab: int) -> float:
    ids = torch.tensor([prompt(DECODE_PROMPT, 100 + b, vocab) for b in range(batch)])
    mask = torch.ones_like(ids)

    def gen(k: int) -> float:
        with torch.inference_mode():
            return timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=k,
                                                min_new_tokens=k, do_sample=False,
                                                pad_token_id=0))

    gen(2)
    # Per-token time without the prefill: the difference of a long and a short generation.
    return best(lambda: (gen(DECODE_STEPS + 1) - gen(1)) / DECODE_STEPS, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: demo base, ~150M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model
    tmp = None
    if model_dir is None:
        from kvrelay.engine.demo_model import write_demo_model

        tmp = tempfile.TemporaryDirectory(prefix="kvrelay-bench-")
        model_dir = write_demo_model(os.path.join(tmp.name, "base"), size="base")

    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(model_dir)
    core = make_core(model_dir, args.threads, num_blocks=32 * 8 + 2048 // 16 + 64)
    params = checkpoint_params(model_dir)
    weight_bytes = params * 4  # fp32
    embed = hf_cfg.vocab_size * hf_cfg.hidden_size
    # Decoder-layer weights; the LM head (embed) runs once per prompt, for its last position.
    body_params = params - embed * (1 if hf_cfg.tie_word_embeddings else 2)
    # Bytes a decode step must read: everything but the input embedding table (a gather).
    step_bytes = weight_bytes - (0 if hf_cfg.tie_word_embeddings else embed * 4)
    heads, hd = hf_cfg.num_attention_heads, hf_cfg.hidden_size // hf_cfg.num_attention_heads
    hd = getattr(hf_cfg, "head_dim", None) or hd
    layers, vocab = hf_cfg.num_hidden_layers, hf_cfg.vocab_size

    print(f"model {model_dir}: {params / 1e6:.1f}M params, {weight_bytes / 1e6:.0f} MB fp32; "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}", flush=True)
    gflops_ceil = matmul_ceiling(hf_cfg.hidden_size, hf_cfg.intermediate_size, args.reps)
    bw = copy_bandwidth(weight_bytes, args.reps)
    step_floor = step_bytes / (bw * 1e9)
    print(f"ceilings: matmul {gflops_ceil:.1f} GFLOP/s; copy_ {bw:.1f} GB/s "
          f"(read+write) -> decode step >= {step_floor * 1e3:.1f} ms\n", flush=True)

    hf = None
    if not args.skip_hf:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    print(f"{'prefill':>10} {'ours tok/s':>11} {'GFLOP/s':>8} {'of ceil':>8} "
          f"{'hf tok/s':>9} {'ours/hf':>8}")
    for n in PREFILL_LENS:
        t = ours_prefill(core, n, args.reps, vocab)
        flops = 2 * body_params * n + 2 * embed + 2 * n * n * heads * hd * layers
        g = flops / t / 1e9
        row = f"{n:>10} {n / t:>11.0f} {g:>8.1f} {g / gflops_ceil:>8.0%}"
        if hf is not None:
            th = hf_prefill(hf, n, args.reps, vocab)
            row += f" {n / th:>9.0f} {th / t:>8.2f}x"
        print(row, flush=True)

    print(f"\n{'decode B':>10} {'ours tok/s':>11} {'step ms':>8} {'of ceil':>8} "
          f"{'hf tok/s':>9} {'ours/hf':>8}")
    for b in DECODE_BATCHES:
        t = ours_decode_step(core, b, args.reps, vocab)
        row = f"{b:>10} {b / t:>11.1f} {t * 1e3:>8.1f} {step_floor / t:>8.0%}"
        if hf is not None:
            th = hf_decode_step(hf, b, max(1, args.reps - 1), vocab)
            row += f" {b / th:>9.1f} {th / t:>8.2f}x"
        print(row, flush=True)
    print("\nof ceil: prefill = GFLOP/s / matmul ceiling; decode = (weight bytes / copy_ "
          "bandwidth) / step time. Targets: prefill 2048 >= 75%, decode B=1 >= 70%.")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
