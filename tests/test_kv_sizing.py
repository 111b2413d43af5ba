"""How big the KV cache is: ``--kv-cache-memory`` when given; otherwise, on a GPU, what
``--gpu-memory-utilization`` leaves once the largest step has run (vLLM's way), on the CPU
512 MiB.

The GPU's sizing has two parts, each checked here as far as a CPU can: the arithmetic
(``cuda_kv_budget``, with the warm-up step's memory beside the weights) and the warm-up itself,
which runs the largest step the scheduler may build over a cache just large enough for it, lets
that cache go, and binds the real one. On the CPU the platform skips the warm-up (host memory is
the operator's to divide); these tests make the CPU platform take the GPU's path (its memory
measure reads 0 here), so the warm-up runs for real on every model family's cache: one block
table, the hybrid layout's pages, multi-head latent attention's latent cache.
"""

from __future__ import annotations

import random

import pytest

from kvrelay.engine.config import DEFAULT_KV_BYTES, CacheConfig
from kvrelay.engine.cpu.platform import CpuPlatform
from kvrelay.engine.cuda.memory import FREE_FLOOR, cuda_kv_budget
from kvrelay.engine.llm import LLM
from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.sampling_params import SamplingParams

GiB = 2**30


def test_the_gpu_budget_leaves_room_for_the_largest_step() -> None:
    total, weights, step = 80 * GiB, 16 * GiB, 3 * GiB
    # Unasked (None): the share less the weights and the step.
    assert cuda_kv_budget(None, 0.9, free=total - weights, total=total, own=weights,
                          activations=step) == round(0.9 * total) - weights - step
    # Asked: at most that.
    assert cuda_kv_budget(4 * GiB, 0.9, free=total - weights, total=total, own=weights,
                          activations=step) == 4 * GiB
    # Another process holds most of the GPU: the free memory bounds it, less the floor.
    free = 20 * GiB
    assert cuda_kv_budget(None, 0.9, free=free, total=total, own=weights,
                          activations=step) == free - round(FREE_FLOOR * total) - step
    with pytest.raises(RuntimeError, match=r"largest step takes 3.0 GiB.*--max-num-batched"):
        cuda_kv_budget(None, 0.2, free=total - weights, total=total, own=weights,
                       activations=step)


def test_the_cpu_default_and_the_config() -> None:
    assert CacheConfig().kv_cache_memory is None
    assert CacheConfig(kv_cache_memory="1GiB").kv_cache_memory == GiB
    platform = CpuPlatform.__new__(CpuPlatform)
    assert platform.kv_budget(None, 0.9) == DEFAULT_KV_BYTES
    assert platform.kv_budget(GiB, 0.9) == GiB
    assert not platform.warms_up_before_kv(None)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "deepseek_v2_lite"])
def test_the_warm_up_runs_the_largest_step_then_binds_the_real_cache(hf_model_dir, monkeypatch,
                                                                    arch: str) -> None:
    model_dir = hf_model_dir(arch)
    kw = dict(block_size=8, max_num_batched_tokens=96, max_num_seqs=8,
              attention_backend="sdpa")
    plain = LLM(model_dir, **kw)
    monkeypatch.setattr(CpuPlatform, "warms_up_before_kv", lambda self, requested: True)
    steps: list[tuple[int, int, int]] = []
    warm_up = ModelRunner.warm_up

    def recorded(self: ModelRunner, tokens: int, rows: int) -> None:
        steps.append((tokens, rows, self.kv_spec.num_blocks))
        warm_up(self, tokens, rows)

    monkeypatch.setattr(ModelRunner, "warm_up", recorded)
    warmed = LLM(model_dir, **kw)
    runner = warmed.engine.runner
    # One step of the scheduler's token budget, logits for as many rows as sequences, over a
    # cache of just the blocks (pages) it needs; then the cache the budget sizes.
    per = 1 if runner.kv_plan is None else runner.kv_plan.num_groups
    assert steps == [(96, 8, per * 96 // 8)]
    assert runner.warm_up_bytes == 0  # nothing to measure on the CPU
    assert runner.kv_spec.num_blocks == plain.engine.runner.kv_spec.num_blocks
    assert runner.kv.data_ptr() == runner.transfer_kv.data_ptr()
    # The model reads the real cache, and computes what an engine that never warmed up does.
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 120) for _ in range(n)] for n in (7, 60)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in warmed.generate(prompts, sp)] == \
        [o.token_ids for o in plain.generate(prompts, sp)]
