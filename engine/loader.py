"""Load a Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections.abc import Iterator

import torch
from safetensors import safe_open

from kvrelay.engine import gemm, kernel_choice
from kvrelay.engine.attention import AttentionFn
from kvrelay.engine.models.arch import ModelArch, load_model_config
from kvrelay.engine.models.fused_decode import FusedDecode
from kvrelay.engine.models.llama import (
    LINEAR_KERNELS,
    LlamaForCausalLM,
    onednn_packing_available,
)
from kvrelay.engine.models.rope import rope_inv_freq
from kvrelay.engine.tensor_parallel import TPShard, shard_model, validate_tp

logger = logging.getLogger(__name__)

# The most rows ``linear_kernel=auto`` times a prefill-sized pass at (a full step of the default
# token budget): ~0.2 s a pass of one layer of the ~150M demo model.
PREFILL_ROWS = 2048

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (kvrelay loads "
                                f"safetensors checkpoints only)")
    return files


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class _Target:
    """Where one checkpoint tensor goes: a parameter, or a row slice of a fused parameter."""

    __slots__ = ("param", "start", "stop")

    def __init__(self, param: torch.Tensor, start: int | None = None, stop: int | None = None):
        self.param, self.start, self.stop = param, start, stop

    def view(self) -> torch.Tensor:
        return self.param if self.start is None else self.param[self.start:self.stop]


def _targets(model: LlamaForCausalLM) -> dict[str, _Target]:
    arch = model.arch
    out: dict[str, _Target] = {"model.embed_tokens.weight": _Target(model.embed),
                               "model.norm.weight": _Target(model.norm.weight)}
    if model.lm_head.weight is not None:
        out["lm_head.weight"] = _Target(model.lm_head.weight)
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.attn, layer.mlp
        out[p + "input_layernorm.weight"] = _Target(layer.input_norm.weight)
        out[p + "post_attention_layernorm.weight"] = _Target(layer.post_attn_norm.weight)
        for kind, fused in (("weight", a.qkv.weight), ("bias", a.qkv.bias)):
            if fused is not None:
                out[p + f"self_attn.q_proj.{kind}"] = _Target(fused, 0, q)
                out[p + f"self_attn.k_proj.{kind}"] = _Target(fused, q, q + kv)
                out[p + f"self_attn.v_proj.{kind}"] = _Target(fused, q + kv, q + 2 * kv)
        out[p + "self_attn.o_proj.weight"] = _Target(a.o.weight)
        if a.o.bias is not None:
            out[p + "self_attn.o_proj.bias"] = _Target(a.o.bias)
        if a.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = _Target(a.q_norm.weight)
            out[p + "self_attn.k_norm.weight"] = _Target(a.k_norm.weight)
        for kind, fused in (("weight", m.gate_up.weight), ("bias", m.gate_up.bias)):
            if fused is not None:
                out[p + f"mlp.gate_proj.{kind}"] = _Target(fused, 0, inter)
                out[p + f"mlp.up_proj.{kind}"] = _Target(fused, inter, 2 * inter)
        out[p + "mlp.down_proj.weight"] = _Target(m.down.weight)
        if m.down.bias is not None:
            out[p + "mlp.down_proj.bias"] = _Target(m.down.bias)
    return out


def load_model(model_dir: str, *, device: torch.device, dtype: torch.dtype,
               attn_fn: AttentionFn, max_positions: int,
               pack: bool | None = None,
               linear_kernel: str = "auto",
               shard: TPShard | None = None,
               prefill_rows: int = PREFILL_ROWS) -> tuple[LlamaForCausalLM, ModelArch]:
    """Build the model and load its weights. ``pack`` (default: on CPU in fp32) repacks the
    linear weights for ``linear_kernel`` (see :func:`choose_linear_kernel`, which times
    ``auto`` at ``prefill_rows``, the rows of a full prefill step). With ``shard`` the model is
    cut to that tensor-parallel rank's part before packing."""
    hf_cfg, arch = load_model_config(model_dir)
    inv_freq, rope_scale = rope_inv_freq(hf_cfg, arch.head_dim)
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(arch, attn_fn, inv_freq.to(device), rope_scale, max_positions)
    model.rotary.to(dtype)
    targets = _targets(model)
    loaded: set[str] = set()
    ignored = 0
    for name, tensor in iter_checkpoint(model_dir):
        target = targets.get(name)
        if target is None:
            if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                ignored += 1  # tied head stored anyway; stale rope buffers of old checkpoints
                continue
            raise ValueError(f"unexpected weight {name!r} in {model_dir} for {arch.architecture}")
        view = target.view()
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(view.shape)}")
        view.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights: {shown}")
    if shard is not None:
        validate_tp(arch, shard.size)
        shard_model(model, shard)
    n_params = sum(p.numel() for p in model.parameters())
    if pack is None:
        pack = device.type == "cpu" and dtype == torch.float32 and (
            onednn_packing_available() or gemm.available())
    kernel = choose_linear_kernel(model, linear_kernel, prefill_rows) if pack else "dense"
    model.fused_decode = FusedDecode.for_model(model) if pack else None
    logger.info("loaded %s (%s, %d layers, %.1fM params) on %s as %s, linears: %s%s",
                model_dir, arch.architecture, arch.num_layers, n_params / 1e6, device, dtype,
                kernel, ", fused decode layers" if model.fused_decode is not None else "")
    return model.eval(), arch


def choose_linear_kernel(model: LlamaForCausalLM, kernel: str,
                         prefill_rows: int = PREFILL_ROWS) -> str:
    """Pack the linears for ``kernel`` (CPU, fp32) and return the one kept: ``panels`` (the
    native panel GEMM, every row count), ``onednn`` (oneDNN's prepacked linear), ``mixed``
    (panels up to 64 rows, oneDNN above: two copies of the weights) or ``auto``: pack both, time
    a decode-sized pass (8 rows through every linear) and a prefill-sized one (``prefill_rows``
    rows, at most :data:`PREFILL_ROWS`, through the first layer) each way, interleaved, and
    keep only what wins, both copies only where oneDNN is > 10% faster at prefill sizes. Which
    one wins depends on the CPU and on the rows: on a Zen 3 the panels won both by 1.1-1.3x; on
    a Cascade Lake Xeon oneDNN's lead at prefill sizes grows with the rows (the tiny demo
    model's first layer: 1.06x at 256 rows, 1.2x at 1024, 1.4x at 2048), so a step's real size
    is what is timed."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {'|'.join(LINEAR_KERNELS)}, "
                         f"got {kernel!r}")
    have_panels, have_onednn = gemm.available(), onednn_packing_available()
    if kernel in ("panels", "mixed") and not have_panels:
        raise RuntimeError(f"linear_kernel={kernel}: the native panel GEMM is unavailable "
                           "(it needs AVX2+FMA and a C compiler; see the log)")
    if kernel in ("onednn", "mixed") and not have_onednn:
        raise RuntimeError(f"linear_kernel={kernel}: this torch build cannot prepack for oneDNN")
    if kernel == "auto" and not (have_panels and have_onednn):
        kernel = "panels" if have_panels else "onednn"
    if kernel == "auto":  # measured before for this build, thread count and shapes?
        prefill_rows = max(65, min(prefill_rows, PREFILL_ROWS))  # oneDNN's side of mixed
        key = kernel_choice.cache_key(model.linear_shapes(), torch.get_num_threads(),
                                      prefill_rows)
        kernel = kernel_choice.load(key) or "auto"
        if kernel != "auto":
            logger.info("linear kernels: %s (as measured before, cache key %s)", kernel, key)
    if kernel != "auto":
        model.pack_weights(onednn=kernel != "panels", panels=kernel != "onednn")
        return kernel
    model.pack_weights(onednn=True, panels=True)
    small = model.time_linears(8)
    large = model.time_linears(prefill_rows, layers=1, reps=3)
    # A second copy of the weights (mixed) only for a clear prefill-sized win: the one-layer
    # sample is short, and on a busy machine a few percent either way is noise.
    kernel = ("panels" if large[0] < 1.1 * large[1] else "mixed") if small[0] < small[1] \
        else "onednn"
    model.keep_linear_kernel(kernel)
    logger.info("linear kernels, panels vs oneDNN: 8 rows %.1f vs %.1f ms, %d rows (1 layer) "
                "%.1f vs %.1f ms: keeping %s", small[0] * 1e3, small[1] * 1e3, prefill_rows,
                large[0] * 1e3, large[1] * 1e3, kernel)
    kernel_choice.save(key, kernel, {"panels_8": small[0] * 1e3, "onednn_8": small[1] * 1e3,
                                     f"panels_{prefill_rows}": large[0] * 1e3,
                                     f"onednn_{prefill_rows}": large[1] * 1e3})
    return kernel
