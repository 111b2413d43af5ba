"""The panels a decode step streams live in one huge-page arena (engine/cpu/hugepages.py)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from kvrelay.engine.cpu import gemm, hugepages
from kvrelay.engine.llm import LLM
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.sampling_params import SamplingParams

needs_arena = pytest.mark.skipif(not hugepages.enabled(), reason="needs MADV_HUGEPAGE (Linux)")


@needs_arena
def test_rehome_keeps_values_and_packs_one_aligned_arena() -> None:
    owners = [SimpleNamespace(t=torch.randn(n, 77)) for n in (5, 1000, 3)]
    owners.append(SimpleNamespace(t=None))  # skipped
    want = [o.t.clone() for o in owners[:3]]
    originals = [weakref.ref(o.t) for o in owners[:3]]
    moved = hugepages.rehome(owners, "t")
    gc.collect()  # the arena lives on in its tensors, not in rehome's locals
    assert all(r() is None for r in originals)  # and nothing holds the originals
    assert moved == sum(-(-o.t.numel() * 4 // 64) * 64 for o in owners[:3])
    assert owners[3].t is None
    for o, w in zip(owners[:3], want, strict=True):
        assert torch.equal(o.t, w) and o.t.is_contiguous()
    ptrs = [o.t.data_ptr() for o in owners[:3]]
    assert ptrs[0] % hugepages.HUGE_PAGE == 0
    assert ptrs[1] - ptrs[0] == -(-5 * 77 * 4 // 64) * 64 and ptrs[2] > ptrs[1]
    owners[0].t.add_(1)  # writable, and the others untouched by it
    assert torch.equal(owners[1].t, want[1])


def test_rehome_off_leaves_tensors_where_they_are(monkeypatch) -> None:
    monkeypatch.setenv("KVRELAY_HUGE_PAGES", "0")
    o = SimpleNamespace(t=torch.randn(4, 4))
    before = o.t
    assert hugepages.rehome([o], "t") == 0 and o.t is before


@needs_arena
@pytest.mark.skipif(not gemm.available(), reason="needs the panel GEMM")
def test_a_loaded_models_panels_share_the_arena_and_decode_the_same(demo_model_dir,
                                                                   monkeypatch) -> None:
    """Every linear's panels in one 2 MiB-aligned arena, in module order; greedy tokens equal
    to an engine whose panels stayed on small pages."""
    prompts = [[5, 6, 7, 8, 9] * 5, [11, 12, 13]]
    llm = LLM(demo_model_dir, linear_kernel="panels", num_blocks=64, num_threads=2)
    lins = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    ptrs = [lin.kernel.panels.data_ptr() for lin in lins]
    assert ptrs[0] % hugepages.HUGE_PAGE == 0 and ptrs == sorted(ptrs)
    assert ptrs[-1] - ptrs[0] < sum(lin.kernel.panels.nbytes for lin in lins)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * len(prompts)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    monkeypatch.setenv("KVRELAY_HUGE_PAGES", "0")
    plain = LLM(demo_model_dir, linear_kernel="panels", num_blocks=64, num_threads=2)
    assert [o.token_ids for o in plain.generate(prompts, params)] == got



@needs_arena
@pytest.mark.skipif(not gemm.available(), reason="needs the panel GEMM")
def test_the_paired_decode_benchmark_runs(demo_model_dir, monkeypatch, capsys) -> None:
    """bench/engine/decode_ab.py switches placement and tuning between steps of one batch and prints
    all four variants. Run in this process (a fresh one spent ~6 s of the ~12 importing torch and
    transformers), one thread as the test process runs, a KV cache the batch fits in; what it
    sets for itself is put back after (the autotune switch, the k-block choice)."""
    from bench.engine import decode_ab
    from kvrelay.engine.cpu import packed_linear

    monkeypatch.setenv("KVRELAY_GEMM_AUTOTUNE", "1")
    monkeypatch.setattr(packed_linear, "default_kblock", packed_linear.default_kblock)
    before = gemm.tuning()
    decode_ab.main(["--model", str(demo_model_dir), "--batch", "2", "--steps", "2",
                    "--seconds", "0.3", "--threads", "1", "--kv-cache-memory", "64MiB"])
    assert gemm.tuning() == before
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["small-pages/in-place", "small-pages/k-major",
                                    "huge-pages/in-place", "huge-pages/k-major"]
    assert rows[0][-1] == "1.000x" and all(float(r[1]) > 0 for r in rows)
