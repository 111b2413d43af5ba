"""KV blocks a long decode holds, windowed vs not, and with the hybrid KV layout: tiny random
checkpoints (transformers' own classes) of a Mistral without a window (dense), a Gemma 3 hybrid
(5 local : 1 global, window 256), a gpt-oss (alternating window-256 and full layers) and a
Mistral with ``sliding_window`` 256 (every layer windowed), each decoding ``--gen`` tokens after
a ``--prompt``-token prompt in the offline engine, ``--batch`` requests at once.

Where every layer is windowed the engine gives back the blocks wholly before the window as the
decode goes (``BlockManager.release_out_of_window``). A hybrid with one block table for every
layer (``--hybrid-kv off``) holds every block: its full layers read them all. With
``--hybrid-kv auto`` (``engine/hybrid_kv.py``) each layer group has its own pages and the
windowed groups give back theirs behind the window: a hybrid's rows count pages, shown as
blocks' worth (pages / layer groups).

``--time``: the decode step time of the hybrid layout against one table, the two engines in one
process taking turns (this host's bandwidth swings 2x), on a Gemma 3 of the demo "base" shape
(hidden 768, 12 layers, 2 global : 10 local, bf16) at ``--time-ctx`` tokens of context, 4x-8x
its ``--time-window``.

    .venv/bin/python -m bench.engine.swa_blocks [--prompt 512 --gen 1536 --batch 4] [--time]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

from kvrelay.engine.demo_model import SPECIAL_IDS, TOKENIZER_VOCAB_SIZE, save_random_checkpoint

WINDOW, BLOCK = 256, 16
_SHAPE = dict(vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False)
_GEMMA = ("Gemma3TextConfig", dict(
    sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"]))
_GPT_OSS = ("GptOssConfig", dict(sliding_window=WINDOW, num_local_experts=4,
                                 num_experts_per_tok=2))
# label -> (config class, its fields, --hybrid-kv)
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "dense (Mistral, no window)": ("MistralConfig", dict(sliding_window=None), "off"),
    "Gemma 3 5:1, one table": (*_GEMMA, "off"),
    "Gemma 3 5:1, hybrid KV": (*_GEMMA, "auto"),
    "gpt-oss 1:1, one table": (*_GPT_OSS, "off"),
    "gpt-oss 1:1, hybrid KV": (*_GPT_OSS, "auto"),
    "all windowed (Mistral)": ("MistralConfig", dict(sliding_window=WINDOW), "off"),
}


def write_model(out_dir: str, config_class: str, extra: dict[str, Any]) -> str:
    import transformers

    config = getattr(transformers, config_class)(**_SHAPE, **extra, **SPECIAL_IDS)
    name = "Gemma3ForCausalLM" if config_class == "Gemma3TextConfig" else \
        config_class.replace("Config", "ForCausalLM")
    save_random_checkpoint(getattr(transformers, name), config, out_dir, 0, "float32",
                           used_vocab=None)
    return out_dir


def held_over_a_decode(model_dir: str, prompt: int, gen: int, batch: int,
                       hybrid: str = "off") -> dict[str, float]:
    """Blocks (a hybrid layout's pages / layer groups) the batch held at its peak and at its
    end, and those given back on the way."""
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.hybrid_blocks import HybridBlockManager
    from kvrelay.engine.sampling_params import SamplingParams

    need = batch * -(-(prompt + gen) // BLOCK)
    core = EngineCore(EngineConfig.from_kwargs(model_dir, block_size=BLOCK, num_blocks=need + 8,
                                               max_num_batched_tokens=prompt * batch, seed=0,
                                               hybrid_kv=hybrid))
    bm = core.block_manager
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", [(7 + 13 * i + j) % 4000 for j in range(prompt)], sp)
    peak = last = per_seq = 0.0
    groups = bm.num_groups if isinstance(bm, HybridBlockManager) else 1
    while core.has_unfinished():
        core.step()
        held = [bm.held_blocks(s) for s in core.seqs.values() if s.block_table]
        if held:
            per_seq = max(held)  # the longest sequence's, at its last step
        if isinstance(bm, HybridBlockManager):
            used = (bm.num_pages - bm.num_free_pages) / groups
        else:
            used = bm.num_blocks - bm.num_free_blocks
        peak = max(peak, used)
        if core.has_unfinished():
            last = used
    released = bm.num_released_pages / groups if isinstance(bm, HybridBlockManager) else \
        bm.num_released_blocks
    return {"peak": peak, "end": last, "released": released, "dense": need, "per_seq": per_seq,
            "preempted": core.stats().num_preemptions}


def held_by_a_reservation(model_dir: str, prompt: int, hybrid: str) -> float:
    """Blocks' worth of KV a decode worker's reservation of a ``prompt``-token handoff holds
    (under the hybrid layout: the pages its first decode reads, the rest never taken)."""
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore

    need = -(-prompt // BLOCK)
    core = EngineCore(EngineConfig.from_kwargs(model_dir, block_size=BLOCK, num_blocks=need + 8,
                                               seed=0, hybrid_kv=hybrid))
    bm = core.block_manager
    free = bm.num_free_pages if hasattr(bm, "num_free_pages") else bm.num_free_blocks
    core.reserve("r", [(7 + j) % 4000 for j in range(prompt)])
    if hasattr(bm, "num_free_pages"):
        return (free - bm.num_free_pages) / bm.num_groups
    return free - bm.num_free_blocks


def on_a_small_pool(model_dir: str, prompt: int, gen: int, batch: int, pool: int,
                    hybrid: str) -> dict[str, float]:
    """``batch`` requests on a pool of ``pool`` blocks (of the layer-group pages under the
    hybrid layout: the same bytes): the most running at once, preemptions, steps to finish."""
    import time

    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.from_kwargs(model_dir, block_size=BLOCK, num_blocks=pool,
                                               max_num_batched_tokens=prompt, seed=0,
                                               hybrid_kv=hybrid))
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", [(7 + 13 * i + j) % 4000 for j in range(prompt)], sp)
    most = steps = 0
    t = time.perf_counter()
    while core.has_unfinished():
        core.step()
        steps += 1
        most = max(most, core.stats().num_running)
    return {"running": most, "preempted": core.stats().num_preemptions, "steps": steps,
            "s": time.perf_counter() - t}


def step_times(ctx: int, window: int, batch: int, rounds: int, steps: int,
               threads: int, backend: str = "auto", model: str = "gemma3") -> dict[str, float]:
    """Median decode step (s) with one table and with the hybrid layout, ``batch`` requests at
    ``ctx`` tokens of context, the two engines taking turns: of a base-shaped Gemma 3, or of
    the tiny gpt-oss of the blocks table (``model="gpt-oss"``: its window ``window`` too)."""
    import statistics
    import time

    from bench.engine.gemma3_decode import decoding_core
    from bench.engine.gemma3_decode import write_model as write_gemma

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if model == "gemma3":
            d = write_gemma(os.path.join(tmp, "gemma3"), "gemma3", window)
        else:
            cls, extra = _GPT_OSS
            d = write_model(os.path.join(tmp, "gpt-oss"), cls, {**extra, "sliding_window": window})
        n = rounds * steps
        cores = {mode: decoding_core(d, batch, ctx, n, threads, True, hybrid_kv=mode,
                                     attention_backend=backend)
                 for mode in ("off", "auto")}
        times: dict[str, list[float]] = {mode: [] for mode in cores}
        for _ in range(rounds):
            for mode, core in cores.items():
                for _ in range(steps):
                    t = time.perf_counter()
                    core.step()
                    times[mode].append(time.perf_counter() - t)
        for mode, core in cores.items():
            out[mode] = statistics.median(times[mode])
            out[f"{mode} min"] = min(times[mode])
            bm = core.block_manager
            seq = next(iter(core.seqs.values()))
            out[f"{mode} blocks/seq"] = bm.held_blocks(seq)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--time", action="store_true", help="also the decode step time A/B")
    ap.add_argument("--only-time", action="store_true", help="the step time A/B alone")
    ap.add_argument("--pool", type=int, default=0,
                    help="also: --batch requests of Gemma 3 on a pool this many whole sequences "
                         "fill, one table vs hybrid (0: skip)")
    ap.add_argument("--no-blocks", action="store_true", help="skip the blocks-held table")
    ap.add_argument("--time-backend", default="auto", choices=["auto", "sdpa"])
    ap.add_argument("--time-model", default="gemma3", choices=["gemma3", "gpt-oss"])
    ap.add_argument("--time-ctx", type=int, default=1024)
    ap.add_argument("--time-window", type=int, default=128)
    ap.add_argument("--time-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per engine per round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.only_time and not args.no_blocks:
        blocks_held(args)
    if args.pool:
        small_pool(args)
    if args.time or args.only_time:
        time_steps(args)


def small_pool(args: argparse.Namespace) -> None:
    need = -(-(args.prompt + args.gen) // BLOCK)
    pool = args.pool * need
    print(f"\n{args.batch} requests x ({args.prompt} + {args.gen}) on a pool of {pool} blocks "
          f"(room for {args.pool} whole sequences of {need} blocks), window {WINDOW}")
    print(f"{'model':<30}{'most running':>14}{'preempted':>11}{'steps':>8}{'seconds':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        dirs: dict[tuple[str, str], str] = {}
        for label, (cls, extra, hybrid) in MODELS.items():
            if cls != "Gemma3TextConfig":
                continue
            key = (cls, repr(extra))
            if key not in dirs:
                dirs[key] = write_model(os.path.join(tmp, str(len(dirs))), cls, extra)
            r = on_a_small_pool(dirs[key], args.prompt, args.gen, args.batch, pool, hybrid)
            print(f"{label:<30}{r['running']:>14.0f}{r['preempted']:>11.0f}{r['steps']:>8.0f}"
                  f"{r['s']:>9.1f}")


def blocks_held(args: argparse.Namespace) -> None:
    print(f"blocks held ({BLOCK} tokens each) over a decode: {args.batch} requests x "
          f"({args.prompt} prompt + {args.gen} generated), window {WINDOW}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':<30}{'peak held':>10}{'at end':>8}{'1 seq':>9}{'given back':>12}"
          f"{'all blocks':>12}{'peak/all':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        dirs: dict[tuple[str, str], str] = {}
        for label, (cls, extra, hybrid) in MODELS.items():
            key = (cls, repr(extra))
            if key not in dirs:
                dirs[key] = write_model(os.path.join(tmp, str(len(dirs))), cls, extra)
            r = held_over_a_decode(dirs[key], args.prompt, args.gen, args.batch, hybrid)
            assert r["preempted"] == 0
            print(f"{label:<30}{r['peak']:>10.0f}{r['end']:>8.0f}{r['per_seq']:>9.0f}"
                  f"{r['released']:>12.0f}{r['dense']:>12.0f}{r['peak'] / r['dense']:>10.1%}")
        n = args.prompt + args.gen
        print(f"\na decode worker's reservation of a {n}-token handoff (P/D), blocks' worth held")
        print(f"{'model':<30}{'held':>10}{'blocks':>10}{'held/blocks':>13}")
        for label, (cls, extra, hybrid) in MODELS.items():
            held = held_by_a_reservation(dirs[(cls, repr(extra))], n, hybrid)
            print(f"{label:<30}{held:>10.0f}{-(-n // BLOCK):>10}{held / -(-n // BLOCK):>13.1%}")


def time_steps(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    t = step_times(args.time_ctx, args.time_window, args.time_batch, args.rounds, args.steps,
                   args.threads, args.time_backend, args.time_model)
    what = ("Gemma 3 base shape (12 layers, 2 global : 10 local), bf16" if
            args.time_model == "gemma3" else "tiny gpt-oss (6 layers, 3 : 3, 4 experts), fp32")
    print(f"\ndecode step, {what}, window {args.time_window}, attention {args.time_backend}, "
          f"B={args.time_batch} at "
          f"~{args.time_ctx} tokens, {args.threads} threads, {args.rounds} rounds x "
          f"{args.steps} steps per engine taking turns; median; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'KV layout':<16}{'ms/step':>9}{'min':>9}{'blocks/seq':>12}")
    for mode, label in (("off", "one table"), ("auto", "hybrid KV")):
        print(f"{label:<16}{t[mode] * 1e3:>9.2f}{t[mode + ' min'] * 1e3:>9.2f}"
              f"{t[mode + ' blocks/seq']:>12.0f}")
    print(f"hybrid / one table: {t['auto'] / t['off']:.3f} (median), "
          f"{t['auto min'] / t['off min']:.3f} (min)")


if __name__ == "__main__":
    main()
