"""A checkpoint's config.json read directly (``plain_config``) gives the engine exactly what
transformers' AutoConfig gives it: the same architecture fields and rope tables, for every test
architecture and for each optional key taken away or switched; where a default would differ by
family, the direct read declines and AutoConfig decides."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import pytest
import torch
from hf_models import ARCHS

from kvrelay.engine.models.arch import (
    arch_from_hf_config,
    load_hf_config,
    load_model_config,
    plain_config,
)
from kvrelay.engine.models.rope import rope_inv_freq

OPTIONAL = ("head_dim", "attention_bias", "mlp_bias", "hidden_act", "sliding_window",
            "layer_types", "use_sliding_window", "rope_parameters", "rope_theta", "rope_scaling",
            "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps", "max_window_layers")


def _variants(raw: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("as saved", raw)]
    out += [(f"without {k}", {kk: v for kk, v in raw.items() if kk != k})
            for k in OPTIONAL if k in raw]
    if "use_sliding_window" in raw:  # Qwen: the flag decides whether the window is kept
        n = raw["num_hidden_layers"]
        for flag in (True, False):
            for layers in (None, ["sliding_attention"] + ["full_attention"] * (n - 1)):
                v = {**raw, "use_sliding_window": flag, "sliding_window": 64,
                     "max_window_layers": 1, "layer_types": layers}
                out.append((f"use_sliding_window={flag}, layer_types={layers}", v))
    if "sliding_window" in raw:
        out.append(("sliding window null", {**raw, "sliding_window": None}))
    return out


def _auto(model_dir: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def _fields(cfg: Any) -> dict[str, Any]:
    arch = asdict(arch_from_hf_config(cfg))
    arch.pop("identity")
    return arch


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_plain_config_reads_what_autoconfig_gives(hf_model_dir, tmp_path, name: str) -> None:
    with open(os.path.join(hf_model_dir(name), "config.json")) as f:
        saved = json.load(f)
    accepted = 0
    for i, (what, raw) in enumerate(_variants(saved)):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps(raw))
        plain = plain_config(raw)
        if plain is None:
            continue
        accepted += 1
        auto = _auto(str(d))
        assert _fields(plain) == _fields(auto), (name, what)
        head_dim = arch_from_hf_config(auto).head_dim
        inv_p, scale_p = rope_inv_freq(plain, head_dim)
        inv_a, scale_a = rope_inv_freq(auto, head_dim)
        assert torch.equal(inv_p, inv_a) and scale_p == scale_a, (name, what)
        assert isinstance(load_hf_config(str(d)), type(plain))
    # What save_pretrained writes is read directly, except scaled rope (llama3's tables).
    assert (plain_config(saved) is None) == (name == "llama3")
    assert accepted


def test_unsupported_and_scaled_configs_are_left_to_autoconfig(demo_model_dir) -> None:
    with open(os.path.join(demo_model_dir, "config.json")) as f:
        raw = json.load(f)
    assert plain_config(raw) is not None
    assert plain_config({**raw, "architectures": ["GPT2LMHeadModel"]}) is None
    assert plain_config({**raw, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 1e4}}) is None
    assert plain_config({**raw, "partial_rotary_factor": 0.5}) is None
    assert plain_config({k: v for k, v in raw.items() if k != "vocab_size"}) is None


def test_identity_is_the_files_whichever_way_they_were_read(hf_model_dir, tmp_path) -> None:
    """Router and workers compare identities: read directly or through AutoConfig (whose
    to_dict carries transformers' defaults and version), the same config.json gives the same
    identity; another config.json gives another."""
    d = hf_model_dir("llama")
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    _, arch = load_model_config(d)
    assert arch_from_hf_config(_auto(d), raw=raw).identity == arch.identity
    assert arch_from_hf_config(_auto(d)).identity != arch.identity  # what it used to be
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 1.234e-6}))
    assert load_model_config(str(other))[1].identity != arch.identity
