"""What gpt-oss's attention sinks cost on the CPU, paired (variants interleaved step by step in
one process: a shared host's bandwidth swings too much for runs one after the other):

- the attention op of one layer for a decode batch (gpt-oss's head shape: head_dim 64, 8 query
  heads per KV head): the native paged decode kernel without and with sinks, torch SDPA, and
  the torch path's sink attention (``sdpa.sink_attention``: what a backend without sinks falls
  back to);
- with ``--steps``, whole decode steps of a dense model of that attention shape (no sinks: the
  same model on either backend), native against SDPA: what a model loses in all when it is
  routed off the native backend (the fused decode layers go with it).

    .venv/bin/python -m bench.engine.sink_fallback --out .bench-out/sink_fallback [--steps]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvrelay.engine.attention import SdpaBackend, StepLayout
from kvrelay.engine.cpu import attention as native
from kvrelay.engine.demo_model import SPECIAL_IDS, TOKENIZER_VOCAB_SIZE, save_random_checkpoint

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 2, 64, 16
# A dense model of gpt-oss's attention shape (gpt-oss-20b: 64 query heads, 8 KV heads of 64),
# shrunk to 16 / 2 heads, hidden 1024, 8 layers.
SHAPE = dict(vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=1024, intermediate_size=2048,
             num_hidden_layers=8, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
             head_dim=HEAD_DIM, max_position_embeddings=8192, rms_norm_eps=1e-5,
             tie_word_embeddings=False)


def write_model(out_dir: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    config = LlamaConfig(**SHAPE, **SPECIAL_IDS)
    save_random_checkpoint(LlamaForCausalLM, config, out_dir, 0, "float32", used_vocab=None)
    return out_dir


def paired(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Each variant once per round, in a fresh random order; seconds per call."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    rng = random.Random(0)
    for fn in variants.values():
        fn()  # warm
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for k in order:
            t = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - t)
    return times


def report(label: str, times: dict[str, list[float]]) -> list[str]:
    first = next(iter(times))
    lines = []
    for k, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, times[first], strict=True))
        lines.append(f"{label:<22} {k:<14} median {statistics.median(ts) * 1e3:8.3f} ms  "
                     f"x{ratio:5.2f} of {first} (paired median)")
    return lines


def attention_op(batch: int, ctx: int, rounds: int) -> list[str]:
    """One layer's decode attention over ``batch`` sequences of ``ctx`` keys."""
    blocks = batch * -(-ctx // BLOCK)
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    vc = torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    per = -(-ctx // BLOCK)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    step = StepLayout(BLOCK, torch.tensor([t[-1] * BLOCK for t in tables]), [1] * batch,
                      [ctx] * batch, tables, 0)
    sinks = torch.randn(HEADS, generator=gen)
    backends = {"native": native.NativeBackend(), "sdpa": SdpaBackend()}
    metas = {}
    for name, b in backends.items():
        b.bind_cache(KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
        metas[name] = b.metadata(step)
    k = v = q[:, :KV_HEADS]
    scale = HEAD_DIM ** -0.5
    variants = {
        "native": lambda: backends["native"](q, k, v, kc, vc, metas["native"], scale, None),
        "native+sinks": lambda: backends["native"](q, k, v, kc, vc, metas["native"], scale,
                                                   None, sinks=sinks),
        "sdpa": lambda: backends["sdpa"](q, k, v, kc, vc, metas["sdpa"], scale, None),
        "sdpa+sinks": lambda: backends["sdpa"](q, k, v, kc, vc, metas["sdpa"], scale, None,
                                               sinks=sinks),
    }
    return report(f"attn B={batch} ctx={ctx}", paired(variants, rounds))


def decode_steps(model_dir: str, batch: int, ctx: int, rounds: int) -> list[str]:
    """Whole decode steps of the dense model, native attention against SDPA."""
    from kvrelay.engine.llm import LLM
    from kvrelay.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    engines = {}
    for name in ("native", "sdpa"):
        llm = LLM(model_dir, attention_backend=name, kv_cache_memory="1GiB", block_size=BLOCK,
                  max_num_batched_tokens=8192)
        core = llm.engine
        rng = random.Random(1)
        for i in range(batch):
            core.add_request(f"{name}{i}", [rng.randrange(3, 4000) for _ in range(ctx)], sp)
        while any(s.num_uncomputed_tokens > 1 for s in core.scheduler.running) \
                or core.scheduler.waiting:
            core.step()
        assert core.runner.backend == name
        engines[name] = core
    variants = {name: core.step for name, core in engines.items()}
    return report(f"step B={batch} ctx={ctx}", paired(variants, rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".bench-out/sink_fallback")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", action="store_true", help="also whole decode steps (minutes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the native attention kernels do not build here")
    lines = [f"threads {args.threads}, heads {HEADS}/{KV_HEADS} x {HEAD_DIM}, fp32, block {BLOCK}"]
    for batch, ctx in ((8, 1024), (32, 1024), (8, 4096)):
        lines += attention_op(batch, ctx, args.rounds)
    if args.steps:
        model_dir = write_model(os.path.join(args.out, "model"))
        for batch, ctx in ((8, 1024), (32, 1024)):
            lines += decode_steps(model_dir, batch, ctx, args.rounds)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
