"""CUDA graphs for decode steps (engine/cuda/graphs.py), everything but the capture checked on
the CPU: the capture sizes, padding a batch to its size, when graphs are used, and the static
buffer path itself, run eagerly here and compared with the normal eager path (logits, and the
KV cache: padding rows write nothing but the scratch block). The replayed graphs are compared
with eager steps on a GPU in tests/gpu/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.cuda.graphs import (
    bucket_for,
    capture_sizes,
    graph_batch,
    graphs_off_reason,
    host_inputs,
)
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence

BS = 16
NUM_BLOCKS = 64
SCRATCH = NUM_BLOCKS - 1  # the core below hands out one block fewer


def test_capture_sizes() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(0) == []


def test_bucket_for() -> None:
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 63, 64)] == \
        [1, 2, 4, 4, 8, 8, 16, 24, 64, 64]
    assert bucket_for(65, sizes) is None and bucket_for(0, sizes) is None
    assert bucket_for(19, capture_sizes(20)) == 20


def test_graphs_only_on_cuda_with_paged_flash() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    ok: dict[str, Any] = dict(enforce_eager=False, max_batch=64, paged_flash=True,
                              num_blocks=100)
    assert graphs_off_reason(cuda, **ok) is None
    assert graphs_off_reason(cpu, **ok) == "not a CUDA device"
    for change, why in ((dict(enforce_eager=True), "enforce-eager"),
                        (dict(max_batch=0), "max-batch 0"),
                        (dict(paged_flash=False), "block_table"),
                        (dict(num_blocks=1), "no block to spare"),
                        (dict(kv_head_groups=2), "KV head groups")):
        reason = graphs_off_reason(cuda, **{**ok, **change})
        assert reason is not None and why in reason


def _seq(name: str, n: int, computed: int) -> Sequence:
    s = Sequence(name, list(range(3, 3 + n)), SamplingParams())
    s.num_computed_tokens = computed
    return s


def test_graph_batch_only_decode_only_steps() -> None:
    sizes = capture_sizes(8)
    a, b = _seq("a", 10, 9), _seq("b", 20, 5)
    assert graph_batch([ScheduledSeq(a, 1)], sizes) == 1
    assert graph_batch([ScheduledSeq(a, 1), ScheduledSeq(b, 1)] * 2 + [ScheduledSeq(a, 1)],
                       sizes) == 8
    assert graph_batch([ScheduledSeq(a, 1), ScheduledSeq(b, 15)], sizes) is None  # mixed
    assert graph_batch([ScheduledSeq(b, 15)], sizes) is None  # prefill
    assert graph_batch([ScheduledSeq(a, 1)] * 9, sizes) is None  # over the bound
    assert graph_batch([], sizes) is None


def test_host_inputs_pad_to_the_scratch_block() -> None:
    a, b = _seq("a", 40, 37), _seq("b", 5, 4)
    a.block_table, b.block_table = [7, 3, 9], [2]
    h = host_inputs([ScheduledSeq(a, 1), ScheduledSeq(b, 1)], 4, BS, 5, SCRATCH)
    assert h.input_ids.tolist() == [3 + 37, 3 + 4, 0, 0]
    assert h.positions.tolist() == [37, 4, 0, 0]
    assert h.slot_mapping.tolist() == [9 * BS + 5, 2 * BS + 4, SCRATCH * BS, SCRATCH * BS]
    assert h.seq_lens.tolist() == [38, 5, 1, 1]
    assert h.block_tables.dtype == torch.int32
    assert h.block_tables.tolist() == [[7, 3, 9, 0, 0], [2, 0, 0, 0, 0], [SCRATCH] * 5,
                                       [SCRATCH] * 5]
    assert h.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert h.cu_seqlens_k.tolist() == [0, 38, 43, 44, 45]
    with pytest.raises(ValueError, match="exceeds"):
        host_inputs([ScheduledSeq(a, 1)], 1, BS, 2, SCRATCH)  # 38 tokens > 2 blocks


# -- the static path against the eager one -----------------------------------------------------
def paged_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                           scale: float, window: int | None) -> torch.Tensor:
    """What flash-attn's varlen kernel computes from the paged cache for one-token queries,
    read from the same fields (``cu_seqlens_q/k``, ``flash_block_table``, ``max_seqlen_k``):
    the CPU stand-in that checks the flash view of the static buffers."""
    assert window is None and meta.max_seqlen_q == 1
    bs = meta.block_size
    lens = torch.diff(meta.cu_seqlens_k).tolist()
    assert max(lens) <= meta.max_seqlen_k
    assert torch.diff(meta.cu_seqlens_q).tolist() == [1] * len(lens)
    out = torch.empty_like(q)
    for b, n in enumerate(lens):
        blocks = meta.flash_block_table[b, :-(-n // bs)].long()
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:n]
        ks, vs = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        qs = q[b:b + 1].transpose(0, 1)  # [H, 1, D]
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], scale=scale,
                                           enable_gqa=True)
        out[b] = o[0, :, 0]
    return out


@pytest.fixture(scope="module")
def cores(demo_model_dir: str) -> Iterator[dict[str, Any]]:
    from kvrelay.engine.block_manager import BlockManager
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore

    out: dict[str, Any] = {}
    for backend in ("sdpa", "native"):
        try:
            core = EngineCore(EngineConfig.from_kwargs(
                demo_model_dir, block_size=BS, num_blocks=NUM_BLOCKS, attention_backend=backend,
                max_model_len=512))
        except RuntimeError:  # the native kernels need a C compiler with OpenMP
            continue
        assert core.runner.decode_graphs is None  # the CPU never captures
        assert core.runner.num_usable_blocks == NUM_BLOCKS
        # As a graphed runner does: the block manager never hands out the scratch block.
        core.block_manager = BlockManager(NUM_BLOCKS - 1, BS, False)
        out[backend] = core
    yield out


LENGTHS = (3, 17, 40, 16, 90, 33, 5, 64, 1)


def _prefilled(core: Any, rng: random.Random) -> list[Sequence]:
    """Sequences of varied lengths whose prompts are cached but for a few decode tokens."""
    runner, bm = core.runner, core.block_manager
    seqs = []
    for i, n in enumerate(LENGTHS):
        s = Sequence(f"s{i}", [rng.randrange(3, 250) for _ in range(n + 12)], SamplingParams())
        assert bm.allocate(s, s.num_tokens)
        if n > 1:
            runner.logits_for([ScheduledSeq(s, n)])
        s.num_computed_tokens = n
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("view", ["sdpa", "native", "flash-reference"])
def test_static_decode_matches_eager(cores: dict[str, Any], view: str) -> None:
    backend = "sdpa" if view == "flash-reference" else view
    if backend not in cores:
        pytest.skip(f"{backend} backend unavailable here")
    core = cores[backend]
    runner, kv = core.runner, core.runner.kv
    static = runner.static_decode(8, scratch_block=SCRATCH)
    if view == "flash-reference":
        from kvrelay.engine.cuda.flash import FlashBackend

        # the flash view of the buffers (no flash-attn needed to lay it out), read by the
        # reference
        static.attention = FlashBackend(paged=True)
        attns = [layer.attn for layer in runner.model.layers]
        saved = [a.attn_fn for a in attns]
    rng = random.Random(0)
    seqs = _prefilled(core, rng)
    try:
        checked_padding = False
        for _ in range(10):
            batch = rng.sample(seqs, rng.randrange(1, 9))
            sched = [ScheduledSeq(s, 1) for s in batch]
            kv[:, :, SCRATCH] = 0  # so that a padding row's write shows
            before = kv.clone()
            if view == "flash-reference":
                for a in attns:
                    a.attn_fn = paged_varlen_reference
            got = static.logits(sched).clone()
            if view == "flash-reference":
                for a, fn in zip(attns, saved, strict=True):
                    a.attn_fn = fn
            # Only the new tokens' slots and the scratch block changed.
            changed = (kv != before).any(-1).any(-1).any(0).any(0).flatten()  # per slot
            new = {s.block_table[s.num_computed_tokens // BS] * BS + s.num_computed_tokens % BS
                   for s in batch}
            scratch = set(range(SCRATCH * BS, (SCRATCH + 1) * BS))
            assert set(changed.nonzero().flatten().tolist()) <= new | scratch
            if len(batch) not in static.sizes:
                assert changed[SCRATCH * BS]  # the padding rows wrote there
                checked_padding = True
            # The eager path (sorted by context length) rewrites the same slots.
            eager = runner.logits_for(sched)
            order = sorted(range(len(batch)), key=lambda j: batch[j].num_computed_tokens)
            want = torch.empty_like(eager)
            want[torch.tensor(order)] = eager
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for s in batch:
                s.num_computed_tokens += 1
        assert checked_padding
    finally:
        if view == "flash-reference":
            for a, fn in zip(attns, saved, strict=True):
                a.attn_fn = fn
        for s in seqs:
            core.block_manager.free(s)


class _Hooks:
    """A connector stand-in that says whether a step needs per-layer hooks."""

    def __init__(self, wants: bool) -> None:
        self.wants = wants
        self.calls: list[str] = []

    def wants_layer_hooks(self, scheduled: Any) -> bool:
        return self.wants

    def start_step(self, scheduled: Any) -> None:
        self.calls.append("start")

    def save_layer(self, layer: int) -> None:
        self.calls.append("layer")

    def end_step(self) -> None:
        self.calls.append("end")


def test_run_replays_only_decode_only_steps(cores: dict[str, Any],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's choice per step: decode-only steps within the bound go through the static
    path (greedy tokens equal to the eager path's), prefill and mixed steps and steps that
    stream KV layer by layer stay eager."""
    core = cores["sdpa"]
    runner = core.runner
    greedy = SamplingParams(temperature=0.0)
    rng = random.Random(1)
    seqs = _prefilled(core, rng)
    for s in seqs:
        s.sampling = greedy
    static = runner.static_decode(4, scratch_block=SCRATCH)
    used: list[int] = []
    real = static.logits

    def spy(sched: Any) -> torch.Tensor:
        used.append(len(sched))
        return real(sched)

    monkeypatch.setattr(static, "logits", spy)
    try:
        # The last prompt token of each: every row samples.
        for s in seqs[:3]:
            s.num_computed_tokens = s.num_tokens - 1
        decode = [ScheduledSeq(s, 1) for s in seqs[:3]]
        eager_tokens = runner.run(decode).tokens
        assert used == []
        runner.decode_graphs = static
        assert runner.run(decode).tokens == eager_tokens
        assert used == [3]
        # A one-token chunk of a prompt that goes on samples nothing.
        seqs[3].num_computed_tokens = 2
        out = runner.run([ScheduledSeq(seqs[3], 1), decode[0]])
        assert out.tokens[0] is None and out.tokens[1] == eager_tokens[0]
        assert used == [3, 2]
        runner.run([ScheduledSeq(seqs[4], 5)])  # prefill
        runner.run([ScheduledSeq(seqs[4], 1), ScheduledSeq(seqs[5], 4)])  # mixed
        runner.run([ScheduledSeq(s, 1) for s in seqs[:5]])  # 5 > max batch 4
        assert used == [3, 2]
        hooks = _Hooks(wants=True)
        runner.run(decode, hooks)  # type: ignore[arg-type]
        assert used == [3, 2] and "layer" in hooks.calls
        hooks = _Hooks(wants=False)
        runner.run(decode, hooks)  # type: ignore[arg-type]
        assert used == [3, 2, 3] and hooks.calls == ["start", "end"]
    finally:
        runner.decode_graphs = None
        for s in seqs:
            core.block_manager.free(s)


def test_flags_reach_the_model_config(demo_model_dir: str) -> None:
    import argparse

    from kvrelay.common.options import add_engine_options, engine_config_from_args
    from kvrelay.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_options(p)
    mc = engine_config_from_args(p.parse_args(["--model", demo_model_dir])).model
    assert (mc.enforce_eager, mc.cuda_graph_max_batch) == (False, 64)
    mc = engine_config_from_args(p.parse_args(
        ["--model", demo_model_dir, "--enforce-eager", "--cuda-graph-max-batch", "8"])).model
    assert (mc.enforce_eager, mc.cuda_graph_max_batch) == (True, 8)
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineConfig.from_kwargs(demo_model_dir, cuda_graph_max_batch=-1)


def test_connector_wants_layer_hooks_only_for_sending_steps() -> None:
    pytest.importorskip("nixl")
    from kvrelay.engine.kv_cache import KVCacheSpec
    from kvrelay.kv_transfer.connector import NixlConnector, NixlConnectorConfig
    from kvrelay.kv_transfer.messages import KVDestination, PendingDestination

    c = NixlConnector(NixlConnectorConfig("prefill-graphs", "model"))
    plain, sending, pending = _seq("a", 10, 9), _seq("b", 10, 9), _seq("c", 10, 9)
    sending.kv_transfer_params = KVDestination("decode-1", [4], notif=b"b")
    pending.kv_transfer_params = PendingDestination()
    step = [ScheduledSeq(plain, 1)]
    assert not c.wants_layer_hooks(step + [ScheduledSeq(sending, 1)])  # no cache registered
    c._tx._spec = KVCacheSpec(1, 1, 16, BS, 8)  # as register_kv_cache leaves it, no NIXL
    assert not c.wants_layer_hooks(step)  # a decode worker's decodes
    assert c.wants_layer_hooks(step + [ScheduledSeq(sending, 1)])
    assert c.wants_layer_hooks(step + [ScheduledSeq(pending, 1)])  # may be named mid-step
    c._tx._layerwise = False  # as attach leaves it where the copy cannot overlap the compute
    assert not c.wants_layer_hooks(step + [ScheduledSeq(sending, 1)])


def test_engine_takes_the_graph_path_end_to_end(demo_model_dir: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's wiring as on CUDA, with the capture left out (the static path then runs
    eagerly on the CPU): the scratch block is withheld from the block manager, decode steps
    go through the static buffers, and greedy outputs equal a plain CPU engine's."""
    plain, want, _ = _run_engine(demo_model_dir, monkeypatch, graphs=False)
    graphed, got, used = _run_engine(demo_model_dir, monkeypatch, graphs=True)
    assert plain.runner.decode_graphs is None
    assert graphed.runner.decode_graphs is not None
    assert graphed.runner.num_usable_blocks == graphed.block_manager.num_blocks == NUM_BLOCKS - 1
    assert graphed.runner.decode_graphs.scratch_block == NUM_BLOCKS - 1
    assert used and max(used) <= 4  # 6 requests: the larger decode steps ran eagerly
    assert got == want


def test_a_tp_replica_runs_graphed_decode_steps_on_every_rank(
        demo_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under tensor parallelism rank 0 tells the other ranks which steps it replays its decode
    graphs for, and each runs the same padded rows from its own static buffers (here eagerly,
    as on the CPU: rank 1, a fresh process, has no graphs and makes its buffers at the first
    such step). A rank running the step eagerly instead would all-reduce fewer rows than rank 0
    (3 decodes padded to 4) and the step would fail: greedy outputs equal a plain engine's."""
    _, want, _ = _run_engine(demo_model_dir, monkeypatch, graphs=False)
    graphed, got, used = _run_engine(demo_model_dir, monkeypatch, graphs=True, tp=2)
    try:
        assert graphed.runner.decode_graphs is not None
        assert graphed.runner.decode_graphs.computes_logits  # rank 0 samples
        assert any(n not in capture_sizes(4) for n in used)  # a padded batch ran
        assert got == want
    finally:
        graphed.runner.close()


def _run_engine(model_dir: str, monkeypatch: pytest.MonkeyPatch, *, graphs: bool,
                tp: int = 1) -> tuple[Any, dict[str, list[int]], list[int]]:
    """A CPU engine's greedy outputs for six requests, and the batch sizes its static decode
    path ran (``graphs``: the runner's wiring as on CUDA, the capture left out)."""
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.cpu.platform import CpuPlatform
    from kvrelay.engine.cuda.graphs import DecodeGraphRunner
    from kvrelay.engine.engine_core import EngineCore

    used: list[int] = []
    with monkeypatch.context() as m:
        if graphs:
            m.setattr(CpuPlatform, "graphs_off_reason", lambda self, **k: None)
            m.setattr(DecodeGraphRunner, "capture", lambda self: None)
        core = EngineCore(EngineConfig.from_kwargs(
            model_dir, block_size=BS, num_blocks=NUM_BLOCKS, attention_backend="sdpa",
            max_model_len=512, cuda_graph_max_batch=4, max_num_batched_tokens=64,
            tensor_parallel_size=tp))
    if graphs:
        real = DecodeGraphRunner.logits

        def spy(self: DecodeGraphRunner, sched: Any) -> torch.Tensor:
            used.append(len(sched))
            return real(self, sched)

        monkeypatch.setattr(DecodeGraphRunner, "logits", spy)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    for i, n in enumerate((4, 30, 70, 9, 18, 50)):
        core.add_request(f"r{i}", [rng.randrange(3, 250) for _ in range(n)], greedy)
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return core, out, used
