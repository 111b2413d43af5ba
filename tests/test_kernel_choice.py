"""``--linear-kernel auto`` measures once per CPU, torch build, native sources, thread count,
prefill size and linear shapes, and later engines of that key take the kept choice without
timing."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.cpu import gemm, kernel_choice
from kvrelay.engine.cpu.packed_linear import onednn_packing_available, packed
from kvrelay.engine.llm import LLM

pytestmark = pytest.mark.skipif(not (gemm.available() and onednn_packing_available()),
                                reason="auto chooses between the panel GEMM and oneDNN")


def test_auto_measures_once_then_takes_the_kept_choice(demo_model_dir, tmp_path,
                                                       monkeypatch) -> None:
    """(fp32 weights, whatever the demo checkpoint's: bf16 has its own key and, on CPUs without
    oneDNN bf16, nothing to choose between; see tests/test_linear_bf16.py.)"""
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    first = LLM(demo_model_dir, num_blocks=16, num_threads=1, dtype="float32").engine.runner.model
    [kept] = (tmp_path / "linear_kernel").glob("*.json")
    chosen = kernel_choice.linear_kernel(first)
    assert chosen in ("panels", "onednn", "mixed")

    def no_timing(*a, **k):
        raise AssertionError("timed again")

    monkeypatch.setattr(kernel_choice, "time_linears", no_timing)
    again = LLM(demo_model_dir, num_blocks=16, num_threads=1, dtype="float32").engine.runner.model
    assert kernel_choice.linear_kernel(again) == chosen  # packed only what was kept
    assert {packed(m).panel_rows for m in kernel_choice.linears(again)} == \
        {packed(m).panel_rows for m in kernel_choice.linears(first)}

    kept.write_text("not json")  # unreadable: measured again
    with pytest.raises(AssertionError, match="timed again"):
        LLM(demo_model_dir, num_blocks=16, num_threads=1, dtype="float32")


def test_the_key_follows_threads_prefill_size_shapes_and_dtype(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    shapes = [(256, 512), (256, 256)]
    fp32 = torch.float32
    key = kernel_choice.cache_key(shapes, 1, 2048, fp32)
    assert key == kernel_choice.cache_key(list(shapes), 1, 2048, fp32)
    assert key != kernel_choice.cache_key(shapes, 2, 2048, fp32)
    assert key != kernel_choice.cache_key(shapes, 1, 512, fp32)
    assert key != kernel_choice.cache_key([(256, 256), (256, 256)], 1, 2048, fp32)
    assert key != kernel_choice.cache_key(shapes, 1, 2048, torch.bfloat16)
    assert kernel_choice.load(key) is None
    kernel_choice.save(key, "mixed", 256, {"panels_8": 1.0})
    assert kernel_choice.load(key) == ("mixed", 256)  # with the rows the panels keep
