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

from kvrelay.engine.attention import AttentionFn
from kvrelay.engine.cpu import gemm, kernel_choice
from kvrelay.engine.cpu.fused_decode import FusedDecode
from kvrelay.engine.models.arch import ModelArch, load_model_config
from kvrelay.engine.models.linear import (
    LINEAR_KERNELS,
    MIXED_PANEL_ROWS,
    onednn_packing_available,
)
from kvrelay.engine.models.llama import LlamaForCausalLM
from kvrelay.engine.models.rope import rope_inv_freq
from kvrelay.engine.tp_shard import TPShard, shard_model, validate_tp

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
    (panels up to ``MIXED_PANEL_ROWS`` rows, oneDNN above: two copies of the weights) or
    ``auto``: pack both and time them (:func:`_measure_linears`), keeping oneDNN's copy only
    where it wins. Kept per build, threads, token budget and shapes (``kernel_choice``)."""
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
    panel_rows = MIXED_PANEL_ROWS
    if kernel == "auto":  # measured before for this build, thread count and shapes?
        prefill_rows = max(MIXED_PANEL_ROWS + 1, min(prefill_rows, PREFILL_ROWS))
        key = kernel_choice.cache_key(model.linear_shapes(), torch.get_num_threads(),
                                      prefill_rows)
        kept = kernel_choice.load(key)
        if kept is not None:
            kernel, panel_rows = kept
            logger.info("linear kernels: %s (as measured before, cache key %s)", kernel, key)
    if kernel != "auto":
        model.pack_weights(onednn=kernel != "panels", panels=kernel != "onednn")
        model.keep_linear_kernel(kernel, panel_rows)
        return kernel
    model.pack_weights(onednn=True, panels=True)
    kernel, panel_rows, measured = _measure_linears(model, prefill_rows)
    model.keep_linear_kernel(kernel, panel_rows)
    kernel_choice.save(key, kernel, panel_rows, measured)
    return kernel


def _measure_linears(model: LlamaForCausalLM, prefill_rows: int) -> tuple[str, int,
                                                                           dict[str, float]]:
    """``auto``: time a decode-sized pass (8 rows through every linear) both ways, then
    prefill-sized ones (128, 256, ... rows up to ``prefill_rows`` through the first layer),
    interleaved, and return the kernel to keep, the rows up to which ``mixed`` takes the panels
    and the times. Both copies only where oneDNN wins the larger passes by > 10% (a second copy
    of the weights for a clear win only: one layer is a short sample, and on a busy machine a
    few percent either way is noise); the panels keep every row count below the first such pass,
    decode steps included (their fused native layers need the panels). Which wins, and from
    which rows, depends on the CPU: on a Zen 3 the panels won every size by 1.1-1.3x; on a
    Cascade Lake Xeon oneDNN's lead grows with the rows (the tiny demo model's first layer:
    1.06x at 256 rows, 1.2x at 1024, 1.4x at 2048) while at 80 rows a decode step through
    the panels took 2/3 of one through oneDNN."""
    small = model.time_linears(8)
    measured = {"panels_8": small[0] * 1e3, "onednn_8": small[1] * 1e3}
    if small[1] <= small[0]:
        kernel, panel_rows = "onednn", 0
    else:
        ladder = [r for r in (128, 256, 512, 1024, 2048) if r < prefill_rows] + [prefill_rows]
        wins: list[int] = []  # rows at which oneDNN won clearly, ascending
        for rows in ladder:
            p, o = model.time_linears(rows, layers=1, reps=3)
            measured[f"panels_{rows}"], measured[f"onednn_{rows}"] = p * 1e3, o * 1e3
            wins = wins + [rows] if p > 1.1 * o else []
            if len(wins) == 2:  # twice in a row: it only grows with the rows
                break
        if wins:
            kernel, panel_rows = "mixed", max(MIXED_PANEL_ROWS, wins[0] // 2)
        else:
            kernel, panel_rows = "panels", 0
    logger.info("linear kernels, panels vs oneDNN (ms): %s: keeping %s%s",
                ", ".join(f"{k.split('_')[1]} rows {measured[k]:.1f} vs "
                          f"{measured['onednn_' + k.split('_')[1]]:.1f}"
                          for k in measured if k.startswith("panels_")),
                kernel, f" (panels up to {panel_rows} rows)" if kernel == "mixed" else "")
    return kernel, panel_rows, measured
