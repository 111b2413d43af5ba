"""Load a Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from kvrelay.engine.attention import AttentionFn
from kvrelay.engine.models.arch import ModelArch, load_model_config
from kvrelay.engine.models.registry import model_class
from kvrelay.engine.models.weights import Cuts
from kvrelay.engine.platform import Platform, platform_for
from kvrelay.engine.tp_shard import TPShard, shard_model, validate_tp

logger = logging.getLogger(__name__)

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
    """Every tensor of the checkpoint, file after file, each read when it is reached (one
    tensor in memory at a time, besides what the caller keeps)."""
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_dir: str, *, device: torch.device, dtype: torch.dtype,
               attn_fn: AttentionFn, max_positions: int,
               shard: TPShard | None = None, platform: Platform | None = None,
               compute_dtype: torch.dtype | None = None,
               model_config: tuple[Any, ModelArch] | None = None,
               ) -> tuple[torch.nn.Module, ModelArch]:
    """Build the model with its weights in ``dtype`` and its activations (norm weights, rope
    tables, the residual stream) in ``compute_dtype`` (default ``dtype``), load its weights, then
    hand it to ``platform`` (default: the device's, with its defaults) to pack for its kernels.
    With ``shard`` the model is cut to that tensor-parallel rank's part before anything is
    read, its shards made on ``device``, and each checkpoint tensor's kept part copied into
    them (``tp_shard.shard_model`` with ``weights.Cuts``): a rank holds its shard and the one
    tensor being read, never the model (the whole parameters are allocated untouched, and
    never written, so they take no memory).

    Each checkpoint tensor is copied straight into its parameter, converted on the way where
    the dtypes differ: a bf16 checkpoint loaded as bf16 never has an fp32 copy of anything
    larger than one norm (peak memory: the model plus the one tensor being read, which
    safetensors maps from the file). ``model_config``: ``load_model_config(model_dir)``, when
    the caller has read it already."""
    hf_cfg, arch = model_config or load_model_config(model_dir)
    act = dtype if compute_dtype is None else compute_dtype
    # Under TP on an accelerator the model is built in host memory (untouched, so free: it is
    # never written) and each rank's shards are made on its device: a device allocation is real
    # at once, and the whole model's parameters would not fit one device (a 70B bf16 model is
    # 141 GB).
    build = device if shard is None else torch.device("cpu")
    with torch.device(build), _default_dtype(dtype):
        model = model_class(arch).from_config(arch, hf_cfg, attn_fn, max_positions,
                                              compute_dtype=act)
    # The targets are the whole model's (the checkpoint's geometry); a rank's model is cut
    # before any tensor is read, and each tensor's kept part goes into its shard (``cuts``).
    targets = model.checkpoint_targets()
    expected = set(targets)
    cuts = None
    if shard is not None:
        validate_tp(arch, shard.size)
        cuts = Cuts(device)
        shard_model(model, shard, cuts)
    # A family's tensors the engine does not run (DeepSeek-V3's multi-token-prediction layer)
    unused = getattr(model, "unused_checkpoint_weight", None)
    loaded: set[str] = set()
    ignored = 0
    for name, tensor in iter_checkpoint(model_dir):
        target = targets.get(name)
        if target is None:
            if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq") \
                    or (unused is not None and unused(name)) or name in loaded:
                ignored += 1  # tied head stored anyway; stale rope buffers of old checkpoints
                continue
            raise ValueError(f"unexpected weight {name!r} in {model_dir} for {arch.architecture}")
        target.load(name, tensor, cuts)
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights: {shown}")
    del targets, cuts  # the whole parameters a cut replaced (never written: never real)
    if build != device:
        model.to(device)  # what is not cut (the embedding, the norms, the head)
    n_params = sum(p.numel() for p in model.parameters())
    platform = platform_for(device) if platform is None else platform
    kernel = platform.prepare_model(model, dtype)
    logger.info("loaded %s (%s, %d layers, %.1fM params) on %s as %s, linears: %s%s",
                model_dir, arch.architecture, arch.num_layers, n_params / 1e6, device, dtype,
                kernel, ", fused decode layers" if model.fused_decode is not None else "")
    return model.eval(), arch
