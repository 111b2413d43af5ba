"""KV blocks a long decode holds, windowed vs not: tiny random checkpoints (transformers' own
classes) of a Mistral without a window (dense), a Gemma 3 hybrid (5 local : 1 global, window
256) and a Mistral with ``sliding_window`` 256 (every layer windowed), each decoding ``--gen``
tokens after a ``--prompt``-token prompt in the offline engine, ``--batch`` requests at once.
Where every layer is windowed the engine gives back the blocks wholly before the window as the
decode goes (``BlockManager.release_out_of_window``); a hybrid's global layers read every
block, so it holds them all (its saving is in the handoff: ``bench.transfer.kv_transfer
--swa``).

    .venv/bin/python -m bench.engine.swa_blocks [--prompt 512 --gen 1536 --batch 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

from kvrelay.engine.demo_model import (
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    init_random_weights,
    quiet_transformers,
    write_demo_tokenizer,
)

WINDOW, BLOCK = 256, 16
_SHAPE = dict(vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense (Mistral, no window)": ("MistralConfig", dict(sliding_window=None)),
    "Gemma 3 hybrid 5:1": ("Gemma3TextConfig", dict(
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    "all windowed (Mistral)": ("MistralConfig", dict(sliding_window=WINDOW)),
}


def write_model(out_dir: str, config_class: str, extra: dict[str, Any]) -> str:
    import transformers

    bos, eos, pad = (SPECIAL_TOKENS.index(t) for t in ("<s>", "</s>", "<pad>"))
    config = getattr(transformers, config_class)(**_SHAPE, **extra, bos_token_id=bos,
                                                 eos_token_id=eos, pad_token_id=pad)
    name = "Gemma3ForCausalLM" if config_class == "Gemma3TextConfig" else \
        config_class.replace("Config", "ForCausalLM")
    config.architectures = [name]
    with torch.random.fork_rng(devices=[]):
        model = getattr(transformers, name)(config)
    init_random_weights(model, 0, gain=1.5, norm_jitter=0.2)
    with quiet_transformers():
        model.save_pretrained(out_dir, safe_serialization=True)
    write_demo_tokenizer(out_dir)
    return out_dir


def held_over_a_decode(model_dir: str, prompt: int, gen: int, batch: int) -> dict[str, float]:
    """Blocks the batch held at its peak and at its end, and blocks given back on the way."""
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.sampling_params import SamplingParams

    need = batch * -(-(prompt + gen) // BLOCK)
    core = EngineCore(EngineConfig.from_kwargs(model_dir, block_size=BLOCK, num_blocks=need + 8,
                                               max_num_batched_tokens=prompt * batch, seed=0))
    bm = core.block_manager
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", [(7 + 13 * i + j) % 4000 for j in range(prompt)], sp)
    peak = last = 0
    while core.has_unfinished():
        core.step()
        used = bm.num_blocks - bm.num_free_blocks
        peak = max(peak, used)
        if core.has_unfinished():
            last = used
    return {"peak": peak, "end": last, "released": bm.num_released_blocks,
            "dense": need, "preempted": core.stats().num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"blocks held ({BLOCK} tokens each) over a decode: {args.batch} requests x "
          f"({args.prompt} prompt + {args.gen} generated), window {WINDOW}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'model':<30}{'peak held':>10}{'at end':>8}{'given back':>12}{'all blocks':>12}"
          f"{'peak/all':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, (cls, extra)) in enumerate(MODELS.items()):
            d = write_model(os.path.join(tmp, str(i)), cls, extra)
            r = held_over_a_decode(d, args.prompt, args.gen, args.batch)
            assert r["preempted"] == 0
            print(f"{label:<30}{r['peak']:>10.0f}{r['end']:>8.0f}{r['released']:>12.0f}"
                  f"{r['dense']:>12.0f}{r['peak'] / r['dense']:>10.1%}")


if __name__ == "__main__":
    main()
