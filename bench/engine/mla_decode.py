"""Multi-head latent attention's decode on the CPU beside a Llama of the same width: the
measured cost of its paths. The native fused decode layers (``engine/cpu/fused_decode.py``)
know the Llama layer only; a DeepSeek layer runs op by op over the packed linears, its decode
attention absorbed into the latent space and read by the native paged decode kernel (one KV head
of ``kv_lora_rank + qk_rope_head_dim``: ``engine/models/mla.py``), or by torch SDPA's grouped
decode (the fallback where the native kernels are off). Rows: the Llama with its fused layers,
the Llama op by op (``KVRELAY_FUSED_DECODE=0``), the DeepSeek (V2-Lite's layout scaled down: no
q bottleneck, latent 256 + rope 32, heads of 64 + 32 and values of 64, every layer's MLP dense so
only attention differs) on the native backend and on SDPA. Each the demo "base" width (hidden
768, 12 layers, 12 heads, FFN 3072, vocabulary 32000) in bf16, B requests decoding together over
``--ctx``-token contexts; the KV bytes per token each caches beside.

    .venv/bin/python -m bench.engine.mla_decode [--batch 8] [--ctx 256] [--rounds 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from bench.engine.gemma3_decode import decoding_core, fused
from bench.engine.gemma3_decode import write_model as write_llama
from kvrelay.engine.demo_model import SPECIAL_IDS, save_random_checkpoint

_SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=4096,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
_MLA = dict(q_lora_rank=None, kv_lora_rank=256, qk_rope_head_dim=32, head_dim=32,
            qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=256, first_k_dense_replace=12)  # every layer dense


def write_deepseek(out_dir: str) -> str:
    import transformers

    config: Any = transformers.DeepseekV2Config(**_SHAPE, **_MLA, **SPECIAL_IDS)
    save_random_checkpoint(transformers.DeepseekV2ForCausalLM, config, out_dir, 0, "bfloat16")
    return out_dir


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
          f"models taking turns; median step; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    print(f"{'model':<38}{'ms/step':>9}{'tokens/s':>10}{'vs Llama fused':>16}{'KV B/token':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        llama = write_llama(os.path.join(tmp, "llama"), "llama")
        ds = write_deepseek(os.path.join(tmp, "deepseek"))
        rows = [("Llama GQA 3:1, fused decode layers", llama, True, "auto"),
                ("Llama GQA 3:1, op by op", llama, False, "auto"),
                ("DeepSeek MLA, native paged decode", ds, True, "native"),
                ("DeepSeek MLA, torch SDPA decode", ds, True, "sdpa")]
        n = args.rounds * args.steps
        cores = []
        for _, d, f, backend in rows:
            with fused(f):
                cores.append(decoding_core(d, args.batch, args.ctx, n, args.threads, f)
                             if backend == "auto" else
                             _core(d, args.batch, args.ctx, n, args.threads, backend))
        times: list[list[float]] = [[] for _ in rows]
        for _ in range(args.rounds):
            for core, ts in zip(cores, times, strict=True):
                for _ in range(args.steps):
                    t = time.perf_counter()
                    core.step()
                    ts.append(time.perf_counter() - t)
        base = statistics.median(times[0])
        for (label, _, f, _), core, ts in zip(rows, cores, times, strict=True):
            t = statistics.median(ts)
            spec = core.runner.kv_spec
            per_token = spec.bytes_per_block_all_layers // spec.block_size
            ran_fused = core.runner.model.fused_decode is not None
            note = "" if ran_fused == f else " (fused layers declined)"
            print(f"{label:<38}{t * 1e3:>9.2f}{args.batch / t:>10.1f}{base / t:>16.0%}"
                  f"{per_token:>12}{note}")


def _core(model_dir: str, batch: int, ctx: int, steps: int, threads: int, backend: str) -> Any:
    from bench.engine.core_runs import make_core, prompt
    from kvrelay.engine.sampling_params import SamplingParams

    core = make_core(model_dir, threads, num_blocks=batch * (ctx + steps + 32) // 16 + 16,
                     attention_backend=backend)
    sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", prompt(ctx, i, 4000), sp)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.seqs.values()):
        core.step()
    return core


if __name__ == "__main__":
    main()
