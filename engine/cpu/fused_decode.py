"""Decode steps of the Llama family, with or without small prefill chunks beside the decodes,
one native call per decoder layer.

Called op by op from Python, a decoder layer is ~10 native calls and as many torch ops, each
with its ctypes call, OpenMP fork/join and fresh output tensor. At decode sizes that glue rather
than the arithmetic was ~3.5 ms of a 24 ms batch-1 step of the ~150M demo model, and more than
half a step of the ~7M one. ``engine/cpu/csrc/decode_layer.c`` runs the same kernels for a whole
layer inside one parallel region instead (see there), so the results are those of the per-op
path, bit for bit.

It applies to steps of decodes (one token per sequence) and prefill chunks that the native
prefill kernel runs (at most ``MAX_MIXED_ROWS`` rows in all: past that the glue is a small part
of the step), without padding rows, on a CPU model of fp32 activations with the native
attention backend over an fp32 or bf16 KV cache, whose linears hold panel-packed weights, fp32
or bf16 (one dtype throughout: the kernels widen bf16 in registers), and are not
tensor-parallel shards, of a dense model (a mixture of experts takes the per-op path), without
per-head q/k norms and without a per-layer KV hook (layer-by-layer KV streaming); any other step
takes the per-op path. A mixed step was ~1 ms
of glue slower than its arithmetic on the ~7M model (a 16-token chunk beside 8 decodes: 4.1 ms
against 1.5 for the decodes alone), which an ITL cap has to leave room for. Where the model's
last layer would run only the rows that are read (``AttentionMetadata.last_layer``), the fused
path runs it for every row and returns those rows: the chunk rows' last-layer arithmetic is
small at these sizes. A cache in KV head groups (``--kv-head-groups``) is passed as group 0's
views and the distance between groups.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import TYPE_CHECKING

import torch

from kvrelay.engine.cpu import gemm, native, prefetch_tuner
from kvrelay.engine.cpu.attention import (
    KV_DTYPES,
    MIN_PART_TOKENS,
    NativeBackend,
    NativeMetadata,
)
from kvrelay.engine.cpu.packed_linear import packed
from kvrelay.engine.cpu.prefetch_tuner import PrefetchTuner
from kvrelay.engine.models.linear import Linear

if TYPE_CHECKING:
    from kvrelay.engine.models.llama import LlamaForCausalLM

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
MAX_MIXED_ROWS = 128  # rows of a step with prefill chunks that the fused path takes
# Stand-ins for the decodes' tables and lengths, or the spans, of a step without them (read by
# nothing: the native layer sees zero rows of that kind).
_NO_TABLES = torch.zeros((1, 1), dtype=torch.int32)
_NO_SPANS = torch.zeros((3, 0), dtype=torch.int32)


class _Layer(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("qkv", "qkv_b", "o", "o_b", "gu", "gu_b", "down", "down_b",
                                  "post_w", "next_w", "k_cache", "v_cache")] + \
        [(n, _I64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "window")] + \
        [(n, _F32) for n in ("eps", "next_eps", "scale")] + \
        [(n, _I64) for n in ("kv_groups", "group_stride", "kblock")] + \
        [("final_w", _P), ("final_eps", _F32), ("in_w", _P), ("in_eps", _F32)] + \
        [(n, _I64) for n in ("wdtype", "kv_dtype")]

# The kernels' codes for the panels' and the caches' dtypes (csrc/abi.h's KVR_DTYPE_*).
_DTYPES = KV_DTYPES


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("cos", _P), ("sin", _P), ("positions", _P), ("max_pos", _I64),
                ("slots", _P), ("tables", _P),
                ("lens", _P), ("width", _I64), ("block_size", _I64), ("min_part", _I64),
                ("h", _P), ("x", _P), ("nthreads", _INT),
                ("prefill_rows", _I64), ("spans", _I64), ("span_width", _I64),
                ("span_start", _P), ("span_len", _P), ("span_ctx", _P), ("span_tables", _P)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def enabled() -> bool:
    """Off with ``KVRELAY_FUSED_DECODE=0`` (to measure the per-op path beside it)."""
    return os.environ.get("KVRELAY_FUSED_DECODE", "1") != "0"


class FusedDecode:
    """The native per-layer decode path of one model (:meth:`for_model` says whether it has
    one); :meth:`run` takes a step or declines it."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.max_rows = min(packed(lin).panel_rows for layer in model.layers
                            for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up,
                                        layer.mlp.down))
        self._layers: list[_Layer] | None = None
        self._cache_ptr = 0  # the K cache the structs point into (rebound: rebuild them)
        self._normed: tuple[torch.Tensor, torch.Tensor] | None = None  # (h, its final norm)
        self.tuner = PrefetchTuner(gemm.picked_tuning().pf_min_rows, gemm.set_prefetch_min_rows) \
            if prefetch_tuner.applies() else None

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> FusedDecode | None:
        """The fused path for ``model``, or None where it does not apply."""
        if not enabled() or native.load() is None:  # the ABI check pins the library's symbols
            return None
        if model.arch.is_moe:  # the native layer's MLP is the dense SwiGLU: MoE runs per op
            return None
        if model.arch.kv_latent:  # MLA: its attention is not the native layer's
            return None
        # fp32 activations (the embedding's rows widened as they are gathered: it may be bf16)
        if model.embed.device.type != "cpu" \
                or getattr(model, "compute_dtype", torch.float32) != torch.float32 \
                or model.rotary.cos.dtype != torch.float32 or not model.rotary.cos.is_contiguous():
            return None
        if 2 * model.rotary.cos.shape[-1] != model.arch.head_dim:  # a partial rotary (Phi-4-mini)
            return None
        panel_dtypes = set()
        for layer in model.layers:
            a, m = layer.attn, layer.mlp
            lins = (a.qkv, a.o, m.gate_up, m.down)
            if a.q_norm is not None or not isinstance(a.attn_fn, NativeBackend) or a.head_dim % 2 \
                    or getattr(a, "sinks", None) is not None \
                    or any(type(lin) is not Linear or (k := packed(lin)) is None
                           or k.panels is None for lin in lins):
                return None
            panel_dtypes.update(packed(lin).panels.dtype for lin in lins)
            fp32 = [lin.bias for lin in lins] + [layer.input_norm.weight,
                                                 layer.post_attn_norm.weight, model.norm.weight]
            if any(t is not None and t.dtype != torch.float32 for t in fp32):
                return None
        # one dtype of panels throughout, fp32 or bf16 (the cache's is checked as it is bound)
        if len(panel_dtypes) != 1 or not panel_dtypes <= _DTYPES.keys():
            return None
        return cls(model)

    def _build(self) -> list[_Layer]:
        model, arch = self.model, self.model.arch
        layers = []
        for i, layer in enumerate(model.layers):
            a, m = layer.attn, layer.mlp
            nxt = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else None
            assert a.k_cache is not None and a.v_cache is not None
            assert a.k_cache.is_contiguous() and a.v_cache.is_contiguous()
            groups = max(1, len(a.kv_groups))
            qkv, o, gu, down = (packed(lin) for lin in (a.qkv, a.o, m.gate_up, m.down))
            kblock = qkv.kblock
            assert all(k.kblock == kblock and k.panels.dtype == qkv.panels.dtype
                       for k in (o, gu, down))
            assert a.v_cache.dtype == a.k_cache.dtype
            # KV head groups: every group's views equally far apart (one [G, ...] tensor).
            esz = a.k_cache.element_size()
            stride = (a.kv_groups[1][0].data_ptr() - a.k_cache.data_ptr()) // esz \
                if groups > 1 else 0
            assert all(k.data_ptr() - a.k_cache.data_ptr() == g * stride * esz and
                       v.data_ptr() - a.v_cache.data_ptr() == g * stride * esz
                       for g, (k, v) in enumerate(a.kv_groups))
            layers.append(_Layer(
                _ptr(qkv.panels), _ptr(a.qkv.bias), _ptr(o.panels), _ptr(a.o.bias),
                _ptr(gu.panels), _ptr(m.gate_up.bias), _ptr(down.panels),
                _ptr(m.down.bias), _ptr(layer.post_attn_norm.weight),
                _ptr(None if nxt is None else nxt.weight), _ptr(a.k_cache), _ptr(a.v_cache),
                arch.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, m.inter,
                a.window or 0, layer.post_attn_norm.eps, 0.0 if nxt is None else nxt.eps,
                a.scale, groups, stride, kblock,
                _ptr(model.norm.weight if nxt is None else None), model.norm.eps,
                _ptr(layer.input_norm.weight if i == 0 else None), layer.input_norm.eps,
                wdtype=_DTYPES[qkv.panels.dtype], kv_dtype=_DTYPES[a.k_cache.dtype]))
        self._cache_ptr = model.layers[0].attn.k_cache.data_ptr()
        return layers

    def takes(self, rows: int, meta: NativeMetadata) -> bool:
        """Whether a step of ``rows`` rows with this metadata is one this path runs."""
        if not isinstance(meta, NativeMetadata):  # a cache the native kernels do not read
            return False
        p, nd = meta.num_prefill_tokens, meta.num_decodes
        if meta.on_kv_written or p + nd != rows or meta.slot_mapping.shape[0] != rows \
                or rows > (self.max_rows if not p else min(self.max_rows, MAX_MIXED_ROWS)):
            return False
        if nd and meta.decode_lens is None:  # decodes grouped for SDPA
            return False
        return not p or (meta.prefill_spans is not None and meta.prefill_tables is not None)

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta: NativeMetadata) -> bool:
        """Every layer over the step's rows (``h``, the embeddings, updated in place, as the
        per-op path does; the first layer norms its input itself), if the step is one this path
        takes; False (nothing done) otherwise. The RoPE tables' rows are read at ``positions``
        in place (no per-step copies of them)."""
        rows = h.shape[0]
        tuner = self.tuner
        self._normed = None
        if not self.takes(rows, meta):
            if tuner is not None:
                tuner.skip()
            return False
        k0 = self.model.layers[0].attn.k_cache
        if self._layers is None or k0 is None or k0.data_ptr() != self._cache_ptr:
            self._layers = self._build()
        p = meta.num_prefill_tokens
        tables = meta.decode_tables.contiguous() if meta.num_decodes else _NO_TABLES
        lens = meta.decode_lens if meta.num_decodes else _NO_TABLES
        spans = meta.prefill_spans if p else _NO_SPANS
        span_tables = meta.prefill_tables.contiguous() if p else _NO_TABLES
        assert spans is not None and spans.is_contiguous() and spans.dtype == torch.int32
        rotary, x = self.model.rotary, torch.empty_like(h)
        assert positions.dtype == torch.long and positions.is_contiguous()
        step = _Step(rows, rotary.cos.data_ptr(), rotary.sin.data_ptr(), positions.data_ptr(),
                     rotary.cos.shape[0], meta.slot_mapping.data_ptr(),
                     tables.data_ptr(), lens.data_ptr(), tables.shape[1],
                     meta.block_size, MIN_PART_TOKENS, h.data_ptr(), x.data_ptr(),
                     torch.get_num_threads(), p, spans.shape[1], span_tables.shape[1],
                     spans[0].data_ptr(), spans[1].data_ptr(), spans[2].data_ptr(),
                     span_tables.data_ptr())
        fn = native.load().kvr_decode_layer_f32
        ref = ctypes.byref(step)
        if tuner is not None and not p:  # times decode-only steps (the LM head follows suit)
            tuner.begin(rows)
        elif tuner is not None:
            tuner.skip()
        t0 = time.perf_counter()
        for layer in self._layers:
            rc = fn(ctypes.byref(layer), ref)
            if rc != 0:
                raise RuntimeError(f"native decode layer failed ({rc})")
        if tuner is not None:
            tuner.end(time.perf_counter() - t0)
        self._normed = (h, x)
        return True

    def normed(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The final norm of ``hidden`` where it is the residual stream of the step this path
        last ran (its last layer wrote the norm into ``x``, as the model's own norm computes it:
        the same bits); None otherwise."""
        h, x = self._normed if self._normed is not None else (None, None)
        return x if hidden is h else None
