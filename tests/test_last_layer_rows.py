"""The last decoder layer runs past its K/V projection only for the rows whose hidden states are
read (``AttentionMetadata.last_layer``): a prompt's last row when it samples and every decode.
The rows that are read must come out as they do when every row runs the whole layer, for every
architecture, with mid-prompt chunks, cached prefixes, decodes, sliding windows and KV head
groups; every row's K/V must still reach the cache (the next chunk and the decodes read them)."""

from __future__ import annotations

import pytest
import torch
from hf_models import ARCHS
from test_engine_parity import GEN, GREEDY, hf_tokens, make_core, prompts, run

from kvrelay.engine.attention import forward_context
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence


def step_rows(core, scheduled, all_rows: bool) -> tuple[torch.Tensor, int | None]:
    """The logits of the rows that sample, and how many rows the last layer ran (None: all)."""
    runner = core.runner
    inputs = runner.prepare(scheduled, all_rows=all_rows)
    last = inputs.meta.last_layer
    with forward_context(inputs.meta), torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions)
        idx = inputs.logits_indices  # None: every row samples, in order
        logits = runner.model.compute_logits(hidden if idx is None else
                                             hidden.index_select(0, idx))
    if last is not None:
        assert hidden.shape[0] == last.rows.numel()
    return logits, None if last is None else last.rows.numel()


def mixed_step(core) -> tuple[list[ScheduledSeq], list[Sequence]]:
    """A prompt's middle chunk over a cached prefix (samples nothing), a whole prompt, a last
    chunk over a cached prefix, and two decodes; the cached parts computed beforehand."""
    bm = core.block_manager
    a, b, c, d, e = prompts(5, (60, 19, 50, 30, 41))
    seqs = [Sequence("mid", a, GREEDY), Sequence("whole", b, GREEDY),
            Sequence("last", c, GREEDY), Sequence("dec1", d, GREEDY), Sequence("dec2", e, GREEDY)]
    for s in seqs:
        assert bm.allocate(s, len(s.token_ids))
    done = {"mid": 16, "whole": 0, "last": 24, "dec1": 29, "dec2": 40}
    for s in seqs:  # the cached prefixes, through the full path
        if done[s.request_id]:
            step_rows(core, [ScheduledSeq(s, done[s.request_id])], all_rows=True)
            s.num_computed_tokens = done[s.request_id]
    return [ScheduledSeq(seqs[0], 20), ScheduledSeq(seqs[1], 19), ScheduledSeq(seqs[2], 26),
            ScheduledSeq(seqs[3], 1), ScheduledSeq(seqs[4], 1)], seqs


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_rows_read_match_the_full_last_layer(hf_model_dir, arch: str, groups: int) -> None:
    core = make_core(hf_model_dir(arch), num_blocks=64, kv_head_groups=groups)
    if not core.runner.prune_last:
        pytest.skip("needs the native attention kernels")
    scheduled, seqs = mixed_step(core)
    kv_before = core.runner.kv.clone()
    got, ran = step_rows(core, scheduled, all_rows=False)
    kv_pruned = core.runner.kv.clone()
    core.runner.kv.copy_(kv_before)
    want, ran_all = step_rows(core, scheduled, all_rows=True)
    assert ran == 2 + 2 and ran_all is None  # "whole" and "last" sample; two decodes
    assert got.shape == want.shape == (4, got.shape[1])
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    assert torch.equal(kv_pruned, core.runner.kv)  # every row's K/V, written as before
    for s in seqs:
        core.block_manager.free(s)


def test_a_chunk_that_samples_nothing_runs_no_row_past_the_kv(hf_model_dir) -> None:
    core = make_core(hf_model_dir("llama"), num_blocks=64)
    seq = Sequence("x", prompts(6, (40,))[0], GREEDY)
    assert core.block_manager.allocate(seq, 40)
    inputs = core.runner.prepare([ScheduledSeq(seq, 24)])
    assert inputs.meta.last_layer is not None and inputs.meta.last_layer.rows.numel() == 0
    assert inputs.logits_indices.numel() == 0 and inputs.sampled_order == []
    _, ran = step_rows(core, [ScheduledSeq(seq, 24)], all_rows=False)
    assert ran == 0
    core.block_manager.free(seq)


def test_prompt_logprobs_and_decode_only_steps_keep_every_row(hf_model_dir) -> None:
    core = make_core(hf_model_dir("llama"), num_blocks=64)
    p = prompts(7, (12,))[0]
    wants = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    seq = Sequence("lp", p, wants)
    assert core.block_manager.allocate(seq, 12)
    assert core.runner.prepare([ScheduledSeq(seq, 12)]).meta.last_layer is None
    seq2 = Sequence("d", p, GREEDY)
    assert core.block_manager.allocate(seq2, 12)
    seq2.num_computed_tokens = 11
    assert core.runner.prepare([ScheduledSeq(seq2, 1)]).meta.last_layer is None
    for s in (seq, seq2):
        core.block_manager.free(s)


@pytest.mark.parametrize("arch", ["llama", "mistral_swa", "qwen3"])
def test_served_tokens_match_transformers_with_long_chunks(hf_model_dir, arch: str) -> None:
    """Whole prompts in one step (each samples from its last row only) and chunks, greedy tokens
    as transformers'."""
    model_dir = hf_model_dir(arch)
    core = make_core(model_dir, max_num_batched_tokens=128, long_prefill_threshold=None)
    ps = prompts(8, (70, 33, 5, 64))
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN), (arch, len(p))


def test_a_step_whose_every_row_samples_reads_the_output_as_is() -> None:
    from kvrelay.engine.step_inputs import sampled_rows

    assert sampled_rows([0, 1, 2], [7, 8, 9]) is None  # a decode step: no index, no copy
    assert sampled_rows([2], [7, 8, 9]).tolist() == [2]
    assert sampled_rows([1, 0], [7, 8]).tolist() == [1, 0]  # every row, not in order
    assert sampled_rows([], [7]).tolist() == []
