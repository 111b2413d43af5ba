"""Gemma 3's decode on the CPU beside a Llama of the same shape: the measured cost of its
fallback. The native fused decode layers (``engine/cpu/fused_decode.py``) know the Llama layer
only; Gemma 3 (q/k norms, four "sandwich" norms of ``1 + w`` in fp32, GeGLU, two rope tables)
runs op by op over the same native kernels (packed linears, paged attention). Rows: the Llama
with its fused layers, the Llama op by op (``KVRELAY_FUSED_DECODE=0``), and Gemma 3 (5 local :
1 global, window 512), each the demo "base" shape (hidden 768, 12 layers, 12 heads over 4 KV
heads, FFN 3072, vocabulary 32000, ~150M parameters) in bf16, B requests decoding together
over 256-token contexts.

    .venv/bin/python -m bench.engine.gemma3_decode [--batch 8] [--rounds 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from bench.engine.core_runs import make_core, prompt
from kvrelay.engine.demo_model import SPECIAL_IDS, save_random_checkpoint
from kvrelay.engine.sampling_params import SamplingParams

_SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, head_dim=64,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
_GEMMA = dict(sliding_window=512, query_pre_attn_scalar=64,
              layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                           for i in range(12)])


def write_model(out_dir: str, kind: str, window: int | None = None) -> str:
    """``window``: Gemma's sliding window (default 512)."""
    import transformers

    if kind == "gemma3":
        gemma = _GEMMA if window is None else {**_GEMMA, "sliding_window": window}
        config: Any = transformers.Gemma3TextConfig(**_SHAPE, **gemma, **SPECIAL_IDS)
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.LlamaConfig(**_SHAPE, **SPECIAL_IDS)
        cls = transformers.LlamaForCausalLM
    save_random_checkpoint(cls, config, out_dir, 0, "bfloat16")
    return out_dir


@contextlib.contextmanager
def fused(on: bool) -> Iterator[None]:
    before = os.environ.get("KVRELAY_FUSED_DECODE")
    os.environ["KVRELAY_FUSED_DECODE"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KVRELAY_FUSED_DECODE", None)
        else:
            os.environ["KVRELAY_FUSED_DECODE"] = before


def decoding_core(model_dir: str, batch: int, ctx: int, steps: int, threads: int,
                  use_fused: bool, **kw: Any) -> Any:
    """A core whose ``batch`` requests are prefilled (``ctx`` tokens each) and can decode
    ``steps`` more steps (``kw``: more engine options)."""
    with fused(use_fused):
        core = make_core(model_dir, threads, num_blocks=batch * (ctx + steps + 32) // 16 + 16,
                         **kw)
    sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", prompt(ctx, i, 4000), sp)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.seqs.values()):
        core.step()
    return core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per model per round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"decode, B={args.batch} over {args.ctx}-token contexts, bf16 weights and KV, "
          f"{args.threads} threads; {args.rounds} rounds of {args.steps} steps per model, the "
          f"models taking turns (the host's drift hits each alike); median step; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':<34}{'ms/step':>9}{'tokens/s':>10}{'vs Llama fused':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        llama = write_model(os.path.join(tmp, "llama"), "llama")
        gemma = write_model(os.path.join(tmp, "gemma3"), "gemma3")
        rows = [("Llama, fused decode layers", llama, True), ("Llama, op by op", llama, False),
                ("Gemma 3 5:1, op by op", gemma, True)]
        n = args.rounds * args.steps
        cores = [decoding_core(d, args.batch, args.ctx, n, args.threads, f) for _, d, f in rows]
        times: list[list[float]] = [[] for _ in rows]
        for _ in range(args.rounds):
            for core, ts in zip(cores, times, strict=True):
                for _ in range(args.steps):
                    t = time.perf_counter()
                    core.step()
                    ts.append(time.perf_counter() - t)
        base = statistics.median(times[0])
        for (label, _, f), core, ts in zip(rows, cores, times, strict=True):
            t = statistics.median(ts)
            ran_fused = core.runner.model.fused_decode is not None
            note = "" if ran_fused == f else " (fused layers declined)"
            print(f"{label:<34}{t * 1e3:>9.2f}{args.batch / t:>10.1f}{base / t:>16.0%}{note}")


if __name__ == "__main__":
    main()
