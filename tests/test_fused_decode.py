"""The fused decode layers (engine/cpu/fused_decode.py, engine/cpu/csrc/decode_layer.c) give the
per-op path's results exactly, take every decode step they can (the small prefill steps too:
tests/test_fused_mixed.py), and decline the rest."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy

from kvrelay.engine.attention.metadata import AttentionMetadata
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.cpu import fused_decode, gemm
from kvrelay.engine.cpu.fused_decode import FusedDecode
from kvrelay.engine.cpu.packed_linear import packed
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.kv_connector import KVConnector, ScheduledSeq, TransferEvents
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.step_inputs import row_order

pytestmark = pytest.mark.skipif(not gemm.available(), reason="no native panel GEMM here")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Biases, a tied head, a sliding window that the contexts outgrow, multi-head and grouped KV,
# a head size that is not hidden / heads.
ARCHS = ["llama", "llama_bias", "llama_tied", "mistral_swa", "llama_mha", "llama_hd", "qwen2"]


def make_core(model_dir: str, **kw: object) -> EngineCore:
    opts = dict(block_size=8, num_blocks=256, max_num_batched_tokens=64, seed=0,
                linear_kernel="panels", attention_backend="native")
    opts.update(kw)
    return EngineCore(EngineConfig.from_kwargs(model_dir, **opts))


def count_fused(monkeypatch: pytest.MonkeyPatch, mixed_only: bool = False) -> list[bool]:
    """Records, step by step, whether the fused path took the step (with ``mixed_only``: took
    a step of prefill chunks and decodes)."""
    taken: list[bool] = []
    real_run = FusedDecode.run

    def counting(self: FusedDecode, h: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> bool:
        ok = real_run(self, h, positions, meta)
        taken.append(ok and (not mixed_only or bool(meta.num_prefill_tokens
                                                    and meta.num_decodes)))
        return ok

    monkeypatch.setattr(FusedDecode, "run", counting)
    return taken


def decode_logits(core: EngineCore, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of decode steps over ``prompt`` then ``tokens`` one at a time, for three copies of
    the sequence decoding together (batch 3, contexts 1 apart: different block tables)."""
    runner, bm = core.runner, core.block_manager
    seqs = []
    for i in range(3):
        full = prompt[i:] + tokens
        seq = Sequence(f"s{i}", full, GREEDY)
        seq.num_prompt_tokens = len(prompt) - i
        assert bm.allocate(seq, len(full))
        runner.logits_for([ScheduledSeq(seq, seq.num_prompt_tokens)])
        seq.num_computed_tokens = seq.num_prompt_tokens
        seqs.append(seq)
    out = []
    for _ in tokens[:-1]:
        step = [ScheduledSeq(s, 1) for s in seqs]
        rows = runner.logits_for(step)
        _, order = row_order(step)  # rows come by context length: back to sequence order
        out.append(rows[torch.tensor(order).argsort()])
        for s in seqs:
            s.num_computed_tokens += 1
    for s in seqs:
        bm.free(s)
    return torch.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decode_equals_the_per_op_path_and_transformers(hf_model_dir, arch: str,
                                                              monkeypatch) -> None:
    model_dir = hf_model_dir(arch)
    prompt = list(range(5, 60))  # past mistral_swa's window of 48 within the decodes
    ref = hf_greedy(model_dir, prompt, 10)
    fused_core, plain_core = make_core(model_dir), make_core(model_dir)
    fd = fused_core.runner.model.fused_decode
    assert fd is not None
    plain_core.runner.model.fused_decode = None
    taken = count_fused(monkeypatch)
    fused = decode_logits(fused_core, prompt, ref.token_ids)
    # every decode step; the prompts' steps too where the native prefill kernel runs them
    prompts = 3 if fused_core.runner.attention.native_prefill else 0
    assert taken.count(True) == len(ref.token_ids) - 1 + prompts
    assert taken.count(False) == 3 - prompts
    plain = decode_logits(plain_core, prompt, ref.token_ids)
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)  # the same kernels, bit for bit
    # and transformers' logits for sequence 0 (the full prompt): 1e-4 relative
    ref_dec = ref.logits[1:]
    assert (fused[:, 0] - ref_dec).abs().max() / ref_dec.abs().max() < 1e-4


def test_greedy_generation_through_the_engine_is_unchanged(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama_bias")
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 30, 61)]

    def generate(core: EngineCore) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, GREEDY)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while core.has_unfinished():
            for o in core.step():
                got[o.request_id] += o.new_token_ids
        return got

    plain = make_core(model_dir)
    plain.runner.model.fused_decode = None
    assert generate(make_core(model_dir)) == generate(plain)


def test_declined_where_it_does_not_apply(hf_model_dir, monkeypatch) -> None:
    # per-head q/k norms (Qwen3), the SDPA backend, oneDNN-packed linears: no fused path
    assert make_core(hf_model_dir("qwen3")).runner.model.fused_decode is None
    llama = hf_model_dir("llama")
    assert make_core(llama, attention_backend="sdpa").runner.model.fused_decode is None
    onednn = make_core(llama, linear_kernel="mixed").runner.model.fused_decode
    assert onednn is not None and onednn.max_rows == 64  # mixed: panels up to 64 rows only
    monkeypatch.setattr(fused_decode, "enabled", lambda: False)
    assert make_core(llama).runner.model.fused_decode is None


class _Connector(KVConnector):
    """A connector with nothing to send unless ``sending``: what a decode worker's engine has."""

    def __init__(self, sending: bool = False) -> None:
        self.sending, self.saved = sending, 0

    def register_kv_cache(self, kv: torch.Tensor, spec: object, ranks: object = None) -> None:
        pass

    def wants_layer_hooks(self, scheduled: object) -> bool:
        return self.sending

    def save_layer(self, layer: int) -> None:
        self.saved += 1

    def request_finished(self, seq: Sequence) -> bool:
        return False

    def take_events(self) -> TransferEvents:
        return TransferEvents([], [], [])

    def has_pending(self) -> bool:
        return False


def test_an_engine_with_a_connector_decodes_through_the_fused_layers(hf_model_dir,
                                                                     monkeypatch) -> None:
    """A decode worker's engine has a KV connector: its steps still take the fused path (they
    send nothing, so no per-layer hook is installed), one that sends does not."""
    model_dir = hf_model_dir("llama")
    ran = count_fused(monkeypatch)
    for sending in (False, True):
        ran.clear()
        conn = _Connector(sending)
        core = EngineCore(EngineConfig.from_kwargs(
            model_dir, block_size=8, num_blocks=256, max_num_batched_tokens=64, seed=0,
            linear_kernel="panels", attention_backend="native"), conn)
        core.add_request("a", list(range(5, 20)), GREEDY)
        while core.has_unfinished():
            core.step()
        took = [r for r in ran if r]
        if sending:  # every layer of every step reported, the per-op path throughout
            assert not took and conn.saved > 0
        else:
            assert len(took) == GREEDY.max_tokens and conn.saved == 0  # the prompt's step too


def test_the_last_fused_layer_gives_the_final_norm(hf_model_dir, monkeypatch) -> None:
    """A decode step's final norm comes from the last fused layer (no second pass over h):
    the model's own norm of the same residual stream, bit for bit."""
    core = make_core(hf_model_dir("llama_bias"))
    model = core.runner.model
    for i in range(3):
        core.add_request(f"r{i}", list(range(3, 12 + i)), GREEDY)
    core.step()  # the prompts
    norms = []
    real = type(model.norm).add_and_norm
    monkeypatch.setattr(type(model.norm), "add_and_norm",
                        lambda self, h, d: norms.append(self is model.norm) or real(self, h, d))
    core.step()  # a decode step
    assert model.fused_decode._normed is not None and True not in norms
    h, x = model.fused_decode._normed
    assert torch.equal(x, real(model.norm, h.clone(), None))


BF16_TOKENS = [17, 3, 250, 99, 41, 8, 160, 77, 5, 230]


@pytest.mark.parametrize("kv", ["auto", "float32"])
@pytest.mark.parametrize("arch", ["llama", "llama_bias", "mistral_swa", "qwen2", "llama_tied"])
def test_bf16_fused_decode_equals_the_per_op_path(hf_model_dir, arch: str, kv: str,
                                                  monkeypatch) -> None:
    """A bf16 checkpoint (bf16 panels; a bf16 KV cache under ``auto``, fp32 on request): the
    fused layers widen the weights and the cache as the per-op kernels do and round K and V into
    a bf16 cache as the per-op path's torch store does, so the logits are the same bits."""
    model_dir = hf_model_dir(arch, dtype=torch.bfloat16)
    fused_core = make_core(model_dir, kv_cache_dtype=kv)
    plain_core = make_core(model_dir, kv_cache_dtype=kv)
    model = fused_core.runner.model
    if model.fused_decode is None:
        pytest.skip("no bf16 panels here")
    assert packed(model.layers[0].mlp.down).panels.dtype == torch.bfloat16
    want_kv = torch.bfloat16 if kv == "auto" else torch.float32
    assert model.layers[0].attn.k_cache.dtype == want_kv
    plain_core.runner.model.fused_decode = None
    taken = count_fused(monkeypatch)
    prompt = list(range(5, 60))  # past mistral_swa's window of 48 within the decodes
    fused = decode_logits(fused_core, prompt, BF16_TOKENS)
    assert taken.count(True) == len(BF16_TOKENS) - 1 + 3  # the decodes and the three prompts
    plain = decode_logits(plain_core, prompt, BF16_TOKENS)
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    # and the KV caches the two paths left behind hold the same bits
    for a, b in zip(model.layers, plain_core.runner.model.layers, strict=True):
        assert torch.equal(a.attn.k_cache.view(torch.int16 if kv == "auto" else torch.int32),
                           b.attn.k_cache.view(torch.int16 if kv == "auto" else torch.int32))
