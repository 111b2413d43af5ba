"""Engine throughput beside the machine's roofline and beside transformers, measured in one run.

    .venv/bin/python -m bench.engine.throughput [--model DIR] [--threads 2] [--reps 3]
    .venv/bin/python -m bench.engine.throughput --quick  # every row, small: does it run?
    .venv/bin/python -m bench.engine.throughput --tp 2   # TP=2 (1 thread/rank) vs TP=1 (1, 2 \\
        threads)

With no ``--model`` it writes the ~150M-parameter demo Llama (``kvrelay demo-model --size base``)
to a temporary directory (in ``--dtype``'s dtype; bf16 by default, as real checkpoints are).
The engine serves it as ``--dtype`` says (auto: the checkpoint's): bf16 weights and KV with fp32
activations, or fp32 throughout; ``--threads`` intra-op threads.

Ceilings (the machine is shared and its speed drifts minute to minute, so each measurement is
paired with a ceiling sample taken right beside it, and a ratio is the median over those pairs):
  - matmul: fp32 GFLOP/s of the fastest of ``torch.mm`` (MKL), oneDNN's prepacked linear and
    the native panel GEMM (the engine runs one of the last two) on the model's own projection
    shapes at M = 2048 rows, sampled
    before and after each prefill (their mean). On some CPUs the two differ by 1.7x (MKL on AMD
    takes its AVX2 path), and a ceiling below the engine's own kernel would flatter every row;
  - memory: bandwidth of ``Tensor.copy_`` over a buffer as large as the weights, counted as bytes
    read + bytes written per second (the traffic a copy makes), sampled after each decode step.

Every row prints its ratio to its **roofline**: the larger of its compute floor (FLOPs / matmul
ceiling) and its memory floor (bytes it must read / copy bandwidth), over the measured time.
FLOPs count the decoder layers' matmuls (2 x params x tokens), the LM head for the rows that
sample, and attention (2 x 2 x head_dim x heads x layers per visible query-key pair; causal
pairs only), but the last layer only as far as the result needs it: its K/V projections for
every token, the rest for the rows that sample (the engine skips the others). Bytes count every
weight read once per step (all but the input embedding) plus the cached K and V each decode
reads.

Prefill rows: one prompt of 128 / 512 / 2048 tokens (time to its first token); 8 x 256-token
prompts prefilled in one step; a 2048-token prompt whose first 1536 tokens are a cached prefix
(only the last 512 are computed, attending over all 2048). Decode rows: B requests stepping
together, short (32-token prompts) at B = 1 / 8 / 32, and with mixed context lengths (uniform in
64..1024 tokens) at B = 8 / 32 / 64; tokens/s = B / step time, every timed step holding all B
requests (none can finish during it; they are aborted after). transformers: the same
checkpoint, ``model(ids)`` for prefill and ``generate`` (greedy, KV cache) for decode.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from bench.engine.core_runs import make_core, next_seed, prompt, run_prefill
from bench.engine.moe_model import (
    expected_distinct_experts,
    measured_distinct_experts,
    write_moe_model,
)
from bench.engine.roofline import Ceilings, best, gemm_tuning, prefetch_note, timed
from kvrelay.engine.cpu import gemm, kernel_choice
from kvrelay.engine.cpu.packed_linear import onednn_packing_available
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams

PREFILL_LENS = (128, 512, 2048)
DECODE_BATCHES = (1, 8, 32)
MIXED_BATCHES = (8, 32, 64)
MIXED_CTX = (64, 1024)
DECODE_PROMPT = 32
DECODE_STEPS = 24


@dataclass(frozen=True)
class Model:
    """What the roofline of a row needs to know about the checkpoint."""

    body_params: int  # decoder-layer weights
    embed: int  # vocab x hidden
    step_bytes: int  # bytes of weights one step reads
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int

    kv_proj: int  # K and V projection weights of one layer
    kv_elem: int = 4  # bytes of one cached K or V element (2 in a bf16 cache)
    # A mixture of experts: ``sparse_layers`` layers of ``experts`` routed experts of
    # ``expert_params`` weights each (``expert_bytes`` as held), of which a token runs
    # ``top_k``. ``body_params`` and ``step_bytes`` count every expert; the FLOPs count a
    # token's active ones, and a step's bytes the experts its rows touch
    # (:func:`~bench.engine.moe_model.expected_distinct_experts`).
    experts: int = 0
    top_k: int = 0
    expert_params: int = 0
    expert_bytes: int = 0
    sparse_layers: int = 0
    # Multi-head latent attention (DeepSeek): ``mla_rank`` > 0. The cache is one plane of one
    # "head" of ``head_dim`` (latent + rope) per token (``kv_planes`` 1). A prefill pair costs
    # the up-projected heads' q.k and p.v, 2 H (``mla_qk`` + ``mla_v``); a decode pair the
    # absorbed ones over the latent, 2 H (``head_dim`` + ``mla_rank``). The up- and absorbing
    # projections (kv_b_proj's weights, once per new token) are in the layers' params; a chunk
    # after a cached prefix up-projects the prefix's keys again, not counted (no row flattered).
    kv_planes: int = 2
    mla_rank: int = 0
    mla_qk: int = 0
    mla_v: int = 0

    @property
    def active_body_params(self) -> int:
        """Decoder-layer weights one token runs through: all but the routed experts it did not
        choose (the router, shared experts and dense layers are all run)."""
        return self.body_params - self.sparse_layers * (self.experts - self.top_k) \
            * self.expert_params

    def weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of ``tokens`` rows reads: ``step_bytes`` less the experts none of
        them chose (in expectation, under uniform routing)."""
        untouched = self.experts - expected_distinct_experts(self.experts, self.top_k, tokens)
        return self.step_bytes - self.sparse_layers * untouched * self.expert_bytes

    def flops(self, new_tokens: int, sampled: int, attended_pairs: int,
              sampled_pairs: int | None = None) -> float:
        """Matmul FLOPs a step needs: the layers for every new token, the LM head for the rows
        that sample, attention for every (query, visible key) pair; except that in the last
        layer only the K/V projections need every token, the rest only the ``sampled`` rows,
        which attend over ``sampled_pairs`` keys (every row, ``attended_pairs``, by default:
        decodes all sample). The engine skips the rest (``AttentionMetadata.last_layer``), so
        counting it would flatter a prefill row."""
        layer = self.active_body_params / self.layers
        pairs = attended_pairs if sampled_pairs is None else sampled_pairs
        last = 2 * self.kv_proj * new_tokens + 2 * (layer - self.kv_proj) * sampled
        per_pair = 4 * self.heads * self.head_dim
        if self.mla_rank:  # decode rows (every row samples: no sampled_pairs) absorb
            per_pair = 2 * self.heads * (self.head_dim + self.mla_rank if sampled_pairs is None
                                         else self.mla_qk + self.mla_v)
        return (2 * layer * (self.layers - 1) * new_tokens + last + 2 * self.embed * sampled
                + per_pair * (attended_pairs * (self.layers - 1) + pairs))

    def kv_bytes(self, keys: int) -> int:
        """Bytes of cached K and V (or latents) that ``keys`` visible keys (over all
        sequences) make a step read."""
        return self.kv_planes * keys * self.kv_heads * self.head_dim * self.layers * self.kv_elem


def causal_pairs(n: int, offset: int = 0) -> int:
    """(query, key) pairs of ``n`` queries after ``offset`` cached keys, causally masked."""
    return n * offset + n * (n + 1) // 2


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
def ours_prefill(core: EngineCore, make: Callable[[], list[list[int]]], reps: int,
                 ceil: Ceilings, warm: Callable[[], object] | None = None) \
        -> tuple[float, float]:
    """(best time, median over reps of GFLOP/s-ceiling x time): the second turns into a ratio
    once the FLOPs are known. ``warm`` runs before each timed rep, untimed (e.g. to cache a
    prefix)."""
    run_prefill(core, make())
    pairs = []
    for _ in range(reps):  # the ceiling: the mean of a sample before and one after
        if warm is not None:
            warm()
        before, t = ceil.gflops(), run_prefill(core, make())
        pairs.append(((before + ceil.gflops()) / 2, t))
    return min(t for _, t in pairs), statistics.median(g * t for g, t in pairs)


def ours_decode(core: EngineCore, lengths: list[int], reps: int, vocab: int, ceil: Ceilings,
                model: Model, steps: int = DECODE_STEPS,
                distinct: list[float] | None = None) -> tuple[float, float, float]:
    """Requests with prompts of ``lengths`` decode together: ``steps`` timed steps, each after
    an untimed one, with every one of them in the batch (none can finish: no EOS, no length
    limit within reach), then they are aborted. Returns (median step time of the best rep,
    median over steps of roofline / step time, the same with the read-only bandwidth); each
    step's roofline from the copy and read bandwidths sampled right after it and the matmul
    rate sampled at the start. ``distinct``, where given, gets the experts per sparse layer
    that one more (untimed) step of each rep touched."""
    sp = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    ratios: list[float] = []
    read_ratios: list[float] = []
    b = len(lengths)

    def run() -> float:
        ids = [f"d{next_seed()}-{i}" for i in range(b)]
        for rid, n in zip(ids, lengths, strict=True):
            core.add_request(rid, prompt(n, next_seed(), vocab), sp)
        while any(s.num_uncomputed_tokens > 1 for s in core.scheduler.running) \
                or core.scheduler.waiting:
            core.step()  # the prefills, not counted
        core.step()
        gf = ceil.gflops() * 1e9
        times = []
        for _ in range(steps):
            assert len(core.scheduler.running) == b
            # Untimed: the timed step follows a step, as it does in serving, not the ceiling
            # samples' ~1.8 GB of copy and reads (which left the next B=8 step of the ~150M
            # model 2.5% slower, paired; see engine.txt).
            core.step()
            ctx = sum(s.num_tokens for s in core.scheduler.running)
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
            nbytes = model.weight_bytes(b) + model.kv_bytes(ctx)
            compute = model.flops(b, b, ctx) / gf
            ratios.append(max(nbytes / (ceil.copy_gbs() * 1e9), compute) / times[-1])
            read_ratios.append(max(nbytes / (ceil.read_gbs() * 1e9), compute) / times[-1])
        if distinct is not None:
            distinct.append(measured_distinct_experts(core, b))
        for rid in ids:
            core.abort(rid)
        while core.has_unfinished():
            core.step()
        return statistics.median(times)

    t = best(run, reps)
    return t, statistics.median(ratios), statistics.median(read_ratios)


@contextlib.contextmanager
def unpacked_linears() -> Iterator[None]:
    """Engines built inside leave their linears unpacked (``F.linear`` over the dense weights,
    bf16 ones widened per call) and take no fused decode layers: the CPU platform's path where
    neither the panel GEMM nor oneDNN's packing is available."""
    from unittest import mock

    with mock.patch.multiple("kvrelay.engine.cpu.platform",
                             panels_available=lambda dtype: False,
                             onednn_packing_available=lambda dtype: False):
        yield


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: demo base, ~150M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers")
    ap.add_argument("--attention-backend", default="auto",
                    choices=["auto", "native", "sdpa"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="the engine's --dtype (auto: the checkpoint's); with no --model, the "
                         "demo checkpoint is written in bf16 unless this says float32")
    ap.add_argument("--moe", action="store_true",
                    help="with no --model: the bench's mid-size random Qwen3-MoE "
                         "(bench/engine/moe_model.py: 32 experts, top-4) for the demo Llama")
    ap.add_argument("--mla", action="store_true",
                    help="with no --model: the bench's mid-size random DeepSeek-V2-Lite-like "
                         "(bench/engine/mla_model.py: latent attention, 32 experts, top-4)")
    ap.add_argument("--short", action="store_true",
                    help="only prefill 2048 and decode B=8/32 (issue #55's rows)")
    ap.add_argument("--unpacked", action="store_true",
                    help="the decode rows again with the linears left unpacked (F.linear: a "
                         "CPU without the native GEMM or oneDNN's packing), in the same run")
    ap.add_argument("--quick", action="store_true",
                    help="every row at a size a test can afford (decode rows time 6 steps, "
                         "the mixed rows hold 64-256-token contexts): shows the benchmark runs, "
                         "measures nothing worth keeping")
    ap.add_argument("--tp", type=int, default=1,
                    help="only the tensor-parallel prefill comparison (2048 tokens) at this TP")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model
    tmp = None
    if model_dir is None:
        from kvrelay.engine.demo_model import write_demo_model

        tmp = tempfile.TemporaryDirectory(prefix="kvrelay-bench-")
        dtype = "float32" if args.dtype == "float32" else "bfloat16"
        if args.moe:
            model_dir = write_moe_model(os.path.join(tmp.name, "moe"), dtype=dtype)
        elif args.mla:
            from bench.engine.mla_model import write_mla_model

            model_dir = write_mla_model(os.path.join(tmp.name, "mla"), dtype=dtype)
        else:
            model_dir = write_demo_model(os.path.join(tmp.name, "base"), size="base",
                                         dtype=dtype)
    if args.tp > 1:
        from bench.engine.engine_tp import tp_bench

        return tp_bench(model_dir, args.tp, args.reps)

    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(model_dir)
    steps, mixed_steps, mixed_ctx = (6, 4, (64, 256)) if args.quick else \
        (DECODE_STEPS, 16, MIXED_CTX)
    blocks = 64 * mixed_ctx[1] // 16 + 512
    core = make_core(model_dir, args.threads, num_blocks=blocks,
                     attention_backend=args.attention_backend, dtype=args.dtype)
    runner = core.runner
    params = checkpoint_params(model_dir)
    w_elem = runner.dtype.itemsize  # as the engine holds the weights (2: bf16)
    weight_bytes = params * w_elem
    embed = hf_cfg.vocab_size * hf_cfg.hidden_size
    heads, hd = hf_cfg.num_attention_heads, hf_cfg.hidden_size // hf_cfg.num_attention_heads
    hd = getattr(hf_cfg, "head_dim", None) or hd
    kvh = getattr(hf_cfg, "num_key_value_heads", None) or heads
    arch = runner.model.arch
    expert_params = 3 * arch.hidden_size * arch.moe_intermediate_size if arch.is_moe else 0
    mla: dict[str, int] = {}
    if arch.kv_latent:  # the cache's one latent head; the last layer needs kv_a for every row
        heads, kvh, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
        mla = dict(kv_planes=1, mla_rank=arch.kv_lora_rank, mla_v=arch.v_head_dim,
                   mla_qk=arch.qk_nope_head_dim + arch.qk_rope_head_dim)
    model = Model(
        body_params=params - embed * (1 if hf_cfg.tie_word_embeddings else 2),
        embed=embed,
        # Bytes a step must read: everything but the input embedding table (a gather).
        step_bytes=weight_bytes - (0 if hf_cfg.tie_word_embeddings else embed * w_elem),
        heads=heads, kv_heads=kvh, head_dim=hd, layers=hf_cfg.num_hidden_layers,
        vocab=hf_cfg.vocab_size,
        kv_proj=(1 if mla else 2) * hf_cfg.hidden_size * kvh * hd,
        kv_elem=runner.kv_dtype.itemsize, experts=arch.num_experts if arch.is_moe else 0,
        top_k=arch.num_experts_per_tok, expert_params=expert_params,
        expert_bytes=expert_params * w_elem, sparse_layers=sum(arch.sparse_layers), **mla)
    vocab = model.vocab
    prefill_lens = (2048,) if args.short else PREFILL_LENS
    decode_batches = (8, 32) if args.short else DECODE_BATCHES

    print(f"model {model_dir}: {params / 1e6:.1f}M params, {weight_bytes / 1e6:.0f} MB as "
          f"{runner.dtype} (activations {runner.compute_dtype}, KV {runner.kv_dtype}); "
          f"{args.threads} threads; attention {core.runner.backend}; "
          f"linears {kernel_choice.linear_kernel(core.runner.model)}; {gemm_tuning()}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if model.experts:
        print(f"mixture of experts: {model.experts} experts, top-{model.top_k}, in "
              f"{model.sparse_layers} of {model.layers} layers; a token runs "
              f"{model.active_body_params / 1e6:.1f}M of the layers' "
              f"{model.body_params / 1e6:.1f}M weights; FLOPs count those, a decode step's "
              "bytes the experts its B rows touch in expectation (uniform routing: "
              + ", ".join(f"B={b} {expected_distinct_experts(model.experts, model.top_k, b):.1f}"
                          for b in decode_batches) + " per layer)", flush=True)
    # The matmul ceiling on the model's projection shapes: an MoE's are its experts'.
    inter = arch.moe_intermediate_size if arch.is_moe else hf_cfg.intermediate_size
    ceil = Ceilings(hf_cfg.hidden_size, inter, weight_bytes, runner.dtype)
    mm0 = max(ceil.gflops() for _ in range(args.reps + 2))
    bw0 = max(ceil.copy_gbs() for _ in range(args.reps + 2))
    rd0 = max(ceil.read_gbs() for _ in range(args.reps + 2))
    print(f"ceilings at start: matmul {mm0:.1f} GFLOP/s; copy_ {bw0:.1f} GB/s "
          f"(read+write) -> decode step >= {model.step_bytes / bw0 / 1e6:.1f} ms; read-only "
          f"{rd0:.1f} GB/s -> >= {model.step_bytes / rd0 / 1e6:.1f} ms\n", flush=True)

    hf = None
    if not args.skip_hf:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    print(f"{'prefill':>18} {'ours tok/s':>11} {'GFLOP/s':>8} {'of roof':>8} "
          f"{'hf tok/s':>9} {'ours/hf':>8}")

    def prefill_row(label: str, t: float, ceil_x_t: float, tokens: int, flops: float,
                    hf_len: int | None) -> None:
        g = flops / t / 1e9
        row = f"{label:>18} {tokens / t:>11.0f} {g:>8.1f} {flops / 1e9 / ceil_x_t:>8.0%}"
        if hf is not None and hf_len is not None:
            th = hf_prefill(hf, hf_len, args.reps, vocab)
            row += f" {hf_len / th:>9.0f} {th / t:>8.2f}x"
        print(row, flush=True)

    for n in prefill_lens:
        t, cxt = ours_prefill(core, lambda n=n: [prompt(n, next_seed(), vocab)], args.reps, ceil)
        prefill_row(str(n), t, cxt, n, model.flops(n, 1, causal_pairs(n), n), n)
    if not args.short:
        # Eight 256-token prompts in one step (the budget is 2048 tokens).
        t, cxt = ours_prefill(core, lambda: [prompt(256, next_seed(), vocab) for _ in range(8)],
                              args.reps, ceil)
        prefill_row("8 x 256", t, cxt, 2048, model.flops(2048, 8, 8 * causal_pairs(256), 8 * 256),
                   None)
        # 2048 tokens of which the first 1536 are cached: the prefix is prefilled (untimed) by a
        # request of its own, then the full prompt computes only its last 512 tokens.
        cached = make_core(model_dir, args.threads, num_blocks=1024, prefix_caching=True,
                           attention_backend=args.attention_backend, dtype=args.dtype)
        holder: dict[str, list[int]] = {}

        def warm_prefix() -> None:
            holder["p"] = prompt(2048, next_seed(), vocab)
            run_prefill(cached, [holder["p"][:1536]])

        warm_prefix()
        t, cxt = ours_prefill(cached, lambda: [holder["p"]], args.reps, ceil, warm=warm_prefix)
        prefill_row("2048 (1536 cached)", t, cxt, 512, model.flops(512, 1, causal_pairs(512, 1536),
                                                               2048), None)

    print(f"\n{'decode B':>18} {'ours tok/s':>11} {'step ms':>8} {'of roof':>8} {'of read':>8} "
          f"{'hf tok/s':>9} {'ours/hf':>8}")
    distinct: dict[int, list[float] | None] = {}
    for b in decode_batches:
        distinct[b] = [] if model.experts else None
        t, ratio, rr = ours_decode(core, [DECODE_PROMPT] * b, args.reps, vocab, ceil, model,
                                   steps=steps, distinct=distinct[b])
        row = f"{b:>18} {b / t:>11.1f} {t * 1e3:>8.1f} {ratio:>8.0%} {rr:>8.0%}"
        if hf is not None:
            th = hf_decode_step(hf, b, max(1, args.reps - 1), vocab)
            row += f" {b / th:>9.1f} {th / t:>8.2f}x"
        print(row, flush=True)
    if model.experts:
        print(f"{'':>18} (experts touched per layer, measured: " + ", ".join(
            f"B={b} {statistics.mean(d):.1f}" for b, d in distinct.items()) + ")", flush=True)
    rng = random.Random(0)
    for b in MIXED_BATCHES if not args.short else ():
        lengths = [rng.randint(*mixed_ctx) for _ in range(b)]
        t, ratio, rr = ours_decode(core, lengths, 1, vocab, ceil, model, steps=mixed_steps)
        label = f"{b} ctx {mixed_ctx[0]}-{mixed_ctx[1]}"
        print(f"{label:>18} {b / t:>11.1f} {t * 1e3:>8.1f} {ratio:>8.0%} {rr:>8.0%}", flush=True)
    if (note := prefetch_note(core.runner)) is not None:
        print(f"{'':>18} ({note})", flush=True)
    # The short decode rows again op by op (no fused decode layers), beside the fused ones.
    fused = core.runner.model.fused_decode
    if fused is not None:
        if fused.tuner is not None:
            fused.tuner.skip()  # the CPU's fixed prefetch choice, not the last step's arm
        core.runner.model.fused_decode = None
        for b in decode_batches:
            t, ratio, rr = ours_decode(core, [DECODE_PROMPT] * b, args.reps, vocab, ceil, model,
                                       steps=steps)
            print(f"{f'{b} per-op':>18} {b / t:>11.1f} {t * 1e3:>8.1f} {ratio:>8.0%} {rr:>8.0%}   "
                  "(fused decode layers off)", flush=True)
        core.runner.model.fused_decode = fused
    # The short decode rows again with the linear kernel auto did not pick (oneDNN, or the
    # panels where auto kept oneDNN), so both kernels are measured in the same run.
    picked = kernel_choice.linear_kernel(core.runner.model)
    wd = runner.dtype
    del core, runner
    other = "onednn" if picked != "onednn" else "panels"
    if (other == "onednn" and onednn_packing_available(wd)) or \
            (other == "panels" and gemm.available()):
        alt = make_core(model_dir, args.threads, num_blocks=blocks, linear_kernel=other,
                        attention_backend=args.attention_backend, dtype=args.dtype)
        for b in decode_batches:
            t, ratio, rr = ours_decode(alt, [DECODE_PROMPT] * b, args.reps, vocab, ceil, model,
                                       steps=steps)
            print(f"{f'{b} {other}':>18} {b / t:>11.1f} {t * 1e3:>8.1f} {ratio:>8.0%} {rr:>8.0%}   "
                  f"(--linear-kernel {other}; auto picked {picked})", flush=True)
        del alt
    if args.unpacked:
        with unpacked_linears():
            plain = make_core(model_dir, args.threads, num_blocks=blocks,
                              attention_backend=args.attention_backend, dtype=args.dtype)
        assert kernel_choice.linear_kernel(plain.runner.model) == "dense"
        for b in decode_batches:
            t, ratio, rr = ours_decode(plain, [DECODE_PROMPT] * b, args.reps, vocab, ceil,
                                       model, steps=steps)
            print(f"{f'{b} unpacked':>18} {b / t:>11.1f} {t * 1e3:>8.1f} {ratio:>8.0%} "
                  f"{rr:>8.0%}   (linears unpacked: F.linear)", flush=True)
        del plain
    print("\nof roof: the row's floor (max of FLOPs / matmul ceiling and bytes read / copy_ "
          "bandwidth) over its measured time; each the median over pairs of a measurement and "
          "ceiling samples taken beside it. Targets: prefill 2048 >= 85%, 8 x 256 >= 80%, "
          "decode B=8 and B=32 >= 75%. of read: the same with the bandwidth of a read-only pass "
          "over a weight-sized buffer in place of copy_'s read+write rate (what a decode step's "
          "weight stream can reach).")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
