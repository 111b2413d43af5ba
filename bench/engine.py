"""Engine throughput beside the machine's ceilings and beside transformers, measured in one run.

    .venv/bin/python bench/engine.py [--model DIR] [--threads 2] [--reps 3]

With no ``--model`` it writes the ~150M-parameter demo Llama (``kvrelay demo-model --size base``)
to a temporary directory. Everything runs fp32 on CPU with ``--threads`` intra-op threads.

Ceilings (the machine is shared and its speed drifts minute to minute, so each measurement is
paired with a ceiling sample taken right beside it, and a ratio is the median over those pairs):
  - matmul: fp32 GFLOP/s of ``torch.mm`` on the model's own projection shapes at M = 2048 rows,
    sampled before and after each prefill (their mean);
  - memory: bandwidth of ``Tensor.copy_`` over a buffer as large as the weights, counted as bytes
    read + bytes written per second (the traffic a copy makes), sampled after each decode step.

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
class Ceilings:
    """Samples of the machine's fp32 matmul rate and copy bandwidth."""

    def __init__(self, hidden: int, inter: int, weight_bytes: int):
        m = 2048
        shapes = [(hidden, inter), (inter, hidden), (hidden, hidden)]
        self._mm = [(torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)) for k, n in shapes]
        self._flops = sum(2 * m * k * n for k, n in shapes)
        self._src = torch.randn(weight_bytes // 4)
        self._dst = torch.empty_like(self._src)
        self._bytes = 2 * self._src.numel() * 4
        self.gflops(), self.copy_gbs()  # warm-up

    def gflops(self) -> float:
        """fp32 GFLOP/s of one pass over the projection shapes."""
        return self._flops / timed(lambda: [torch.mm(x, w, out=o) for x, w, o in self._mm]) / 1e9

    def copy_gbs(self) -> float:
        """GB/s (read + write) of one weight-sized ``copy_``."""
        return self._bytes / timed(lambda: self._dst.copy_(self._src)) / 1e9


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
def make_core(model: str, threads: int, num_blocks: int, gemv: bool = True) -> EngineCore:
    cfg = EngineConfig.from_kwargs(model, num_threads=threads, num_blocks=num_blocks,
                                   max_num_batched_tokens=2048, max_num_seqs=64,
                                   enable_prefix_caching=False, gemv_weights=gemv)
    return EngineCore(cfg, eos_token_ids=frozenset())


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (n,), generator=g).tolist()


def ours_prefill(core: EngineCore, n: int, reps: int, vocab: int,
                 ceil: Ceilings) -> tuple[float, float]:
    """(best time to first token, median over reps of GFLOP/s-ceiling x time) — the second
    turns into a ratio once the FLOPs are known."""
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
    pairs = []
    for _ in range(reps):  # the ceiling: the mean of a sample before and one after
        before, t = ceil.gflops(), run()
        pairs.append(((before + ceil.gflops()) / 2, t))
    return min(t for _, t in pairs), statistics.median(g * t for g, t in pairs)


def ours_decode_step(core: EngineCore, batch: int, reps: int, vocab: int, ceil: Ceilings,
                     step_bytes: int) -> tuple[float, float]:
    """(median step time of the best rep, median over steps of floor / step time), the floor
    of each step from the copy bandwidth sampled right after it."""
    sp = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0, ignore_eos=True)
    seeds = iter(range(20_000, 40_000))
    ratios: list[float] = []

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
            if core.has_unfinished():  # the last step also finishes and frees: not counted
                ratios.append(step_bytes / (ceil.copy_gbs() * 1e9) / times[-1])
        return statistics.median(times[:-1] or times)

    t = best(run, reps)
    return t, statistics.median(ratios)


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
    ceil = Ceilings(hf_cfg.hidden_size, hf_cfg.intermediate_size, weight_bytes)
    mm0 = max(ceil.gflops() for _ in range(args.reps + 2))
    bw0 = max(ceil.copy_gbs() for _ in range(args.reps + 2))
    print(f"ceilings at start: matmul {mm0:.1f} GFLOP/s; copy_ {bw0:.1f} GB/s "
          f"(read+write) -> decode step >= {step_bytes / bw0 / 1e6:.1f} ms\n", flush=True)

    hf = None
    if not args.skip_hf:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    print(f"{'prefill':>10} {'ours tok/s':>11} {'GFLOP/s':>8} {'of ceil':>8} "
          f"{'hf tok/s':>9} {'ours/hf':>8}")
    for n in PREFILL_LENS:
        t, ceil_x_t = ours_prefill(core, n, args.reps, vocab, ceil)
        flops = 2 * body_params * n + 2 * embed + 2 * n * n * heads * hd * layers
        g = flops / t / 1e9
        row = f"{n:>10} {n / t:>11.0f} {g:>8.1f} {flops / 1e9 / ceil_x_t:>8.0%}"
        if hf is not None:
            th = hf_prefill(hf, n, args.reps, vocab)
            row += f" {n / th:>9.0f} {th / t:>8.2f}x"
        print(row, flush=True)

    print(f"\n{'decode B':>10} {'ours tok/s':>11} {'step ms':>8} {'of ceil':>8} "
          f"{'hf tok/s':>9} {'ours/hf':>8}")
    for b in DECODE_BATCHES:
        t, ratio = ours_decode_step(core, b, args.reps, vocab, ceil, step_bytes)
        row = f"{b:>10} {b / t:>11.1f} {t * 1e3:>8.1f} {ratio:>8.0%}"
        if hf is not None:
            th = hf_decode_step(hf, b, max(1, args.reps - 1), vocab)
            row += f" {b / th:>9.1f} {th / t:>8.2f}x"
        print(row, flush=True)
    # The same step with the dense GEMV slabs off (oneDNN's packed kernel for one row too).
    del core
    packed = make_core(model_dir, args.threads, num_blocks=64, gemv=False)
    t, ratio = ours_decode_step(packed, 1, args.reps, vocab, ceil, step_bytes)
    print(f"{'1 oneDNN':>10} {1 / t:>11.1f} {t * 1e3:>8.1f} {ratio:>8.0%}   "
          "(--no-gemv-weights)", flush=True)
    print("\nof ceil: prefill = GFLOP/s / matmul ceiling; decode = (weight bytes / copy_ "
          "bandwidth) / step time; each the median over pairs of a measurement and a ceiling "
          "sample taken beside it. Targets: prefill 2048 >= 75%, decode B=1 >= 70%.")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
