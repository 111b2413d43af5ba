"""The demo checkpoint and the HF reference fixtures: deterministic, loadable, not degenerate."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hf_models import ARCHS, hf_forward_logits, hf_greedy

from kvrelay.engine.demo_model import (
    DEMO_SIZES,
    demo_config,
    demo_corpus,
    init_random_weights,
    write_demo_model,
)
from kvrelay.engine.tokenizer import eos_token_ids, load_tokenizer

PROMPT = [1, 5, 205, 2528, 472, 557, 269, 3149, 20, 2, 205, 6, 205]


def digests(d: str) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(d))}


def read_json(*path: str) -> Any:
    with open(os.path.join(*path), encoding="utf-8") as f:
        return json.load(f)


def n_params(cfg: Any) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


# -- demo model --------------------------------------------------------------------------------
def test_demo_model_is_byte_identical_per_seed(demo_model_dir: str, tmp_path: Any) -> None:
    ref = digests(demo_model_dir)
    assert set(ref) == {"config.json", "generation_config.json", "model.safetensors",
                        "tokenizer.json", "tokenizer_config.json"}
    assert digests(write_demo_model(str(tmp_path / "again"), dtype="float32")) == ref
    other = digests(write_demo_model(str(tmp_path / "seed1"), seed=1, dtype="float32"))
    assert other["model.safetensors"] != ref["model.safetensors"]
    assert other["tokenizer.json"] == ref["tokenizer.json"]


def test_demo_model_validates_arguments(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="size"):
        write_demo_model(str(tmp_path), size="huge")
    with pytest.raises(ValueError, match="seed"):
        write_demo_model(str(tmp_path), seed=-1)
    with pytest.raises(ValueError, match="dtype"):
        write_demo_model(str(tmp_path), dtype="float16")


def test_demo_model_is_written_in_bf16_as_real_checkpoints_are(demo_bf16_dir: str,
                                                               demo_model_dir: str) -> None:
    from safetensors import safe_open

    assert read_json(demo_bf16_dir, "config.json")["dtype"] == "bfloat16"
    fp32 = demo_model_dir  # the suite's, written with dtype="float32"
    assert read_json(fp32, "config.json")["dtype"] == "float32"
    with safe_open(os.path.join(demo_bf16_dir, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(fp32, "model.safetensors"), "pt") as b:
        for name in a.keys():  # noqa: SIM118 (safe_open is not a mapping)
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == torch.bfloat16 and y.dtype == torch.float32
            assert torch.equal(x, y.to(torch.bfloat16)), name  # one rounding apart


def test_demo_sizes() -> None:
    tiny, base = demo_config("tiny"), demo_config("base")
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (8, 4)  # GQA
    assert 4e6 < n_params(tiny) < 8e6
    assert 100e6 < n_params(base) < 160e6
    assert base.vocab_size == DEMO_SIZES["base"].vocab_size >= 4096


def test_demo_model_loads_in_transformers(demo_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(demo_model_dir, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tok) == 4096
    assert eos_token_ids(demo_model_dir, tok) == {tok.eos_token_id}
    assert read_json(demo_model_dir, "config.json")["rope_parameters"]["rope_theta"] == 10000.0
    r = hf_greedy(demo_model_dir, PROMPT, 32)
    assert len(r.token_ids) == 32 and len(set(r.token_ids)) >= 8
    assert r.logits.shape == (32, 4096)


def test_demo_tokenizer_round_trips(demo_model_dir: str) -> None:
    tok = load_tokenizer(demo_model_dir)
    corpus = demo_corpus()
    assert 30_000 < len(corpus.encode()) < 100_000
    para = corpus.split("\n\n")[3]
    ids = tok.encode(para)
    assert len(ids) < len(para) / 2.5  # a real BPE, not bytes
    assert tok.decode(ids) == para
    novel = "Zebras 🦓 quietly \u00d7 ∂ \U0001d518 \t\r\n"
    assert tok.decode(tok.encode(novel)) == novel  # byte fallback: anything round-trips


def test_padded_vocab_rows_are_zero() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg)
    init_random_weights(model, 0, used_vocab=32)
    for w in (model.model.embed_tokens.weight, model.lm_head.weight):
        assert w[32:].abs().sum() == 0 and w[:32].abs().min(dim=1).values.gt(0).all()
    state = torch.get_rng_state()
    init_random_weights(model, 0)
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is left alone


# -- HF reference fixtures ---------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hf_fixture_generates(hf_model_dir: Callable[..., str], arch: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    d = hf_model_dir(arch)
    spec = ARCHS[arch]
    cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    assert cfg.architectures == [spec.config_class.replace("Config", "ForCausalLM")]
    assert cfg.vocab_size >= len(AutoTokenizer.from_pretrained(d, local_files_only=True))
    raw = read_json(d, "config.json")
    if spec.legacy_rope:
        assert "rope_parameters" not in raw and "rope_theta" in raw and "rope_scaling" in raw
    else:
        assert "rope_parameters" in raw and "rope_scaling" not in raw
    sharded = os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    assert sharded == (spec.max_shard_size is not None)

    r = hf_greedy(d, PROMPT, 32)
    assert len(r.token_ids) == 32
    assert len(set(r.token_ids)) >= 8, r.token_ids  # not one token forever
    assert r.logits.argmax(-1).tolist() == r.token_ids
    full = hf_forward_logits(d, PROMPT + r.token_ids[:-1])
    torch.testing.assert_close(full[len(PROMPT) - 1:], r.logits, rtol=1e-4, atol=1e-4)


def test_fixture_variants(hf_model_dir: Callable[..., str]) -> None:
    cfg = read_json(hf_model_dir("llama3"), "config.json")
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_theta"] == 500000.0
    qwen3 = read_json(hf_model_dir("qwen3"), "config.json")
    assert qwen3["head_dim"] * qwen3["num_attention_heads"] != qwen3["hidden_size"]
    assert qwen3["tie_word_embeddings"]
    llama_hd = read_json(hf_model_dir("llama_hd"), "config.json")
    assert llama_hd["head_dim"] == 32 and llama_hd["hidden_size"] == 64
    index = read_json(hf_model_dir("llama_sharded"), "model.safetensors.index.json")
    assert len(set(index["weight_map"].values())) >= 3


def test_legacy_rope_keys_load_the_same_model(hf_model_dir: Callable[..., str]) -> None:
    ids = PROMPT * 6  # 78 positions: past original_max_position_embeddings (64)
    legacy = hf_forward_logits(hf_model_dir("llama3"), ids)
    modern = hf_forward_logits(hf_model_dir("llama3", legacy_rope=False), ids)
    default = hf_forward_logits(hf_model_dir("llama3", legacy_rope=False, rope_scaling=None), ids)
    torch.testing.assert_close(legacy, modern, rtol=0, atol=0)
    assert not torch.allclose(legacy, default, atol=1e-3)  # the llama3 scaling takes effect


def test_sliding_window_matters(hf_model_dir: Callable[..., str]) -> None:
    ids = PROMPT * 6
    swa = hf_forward_logits(hf_model_dir("mistral_swa"), ids)
    wide = hf_forward_logits(hf_model_dir("mistral_swa", sliding_window=4096), ids)
    torch.testing.assert_close(swa[:48], wide[:48], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(swa[48:], wide[48:], atol=1e-3)


def test_hf_greedy_eos(hf_model_dir: Callable[..., str]) -> None:
    d = hf_model_dir("llama")
    r = hf_greedy(d, PROMPT, 8)
    assert len(r.token_ids) == 8  # EOS off by default, whatever generation_config.json says
    stopped = hf_greedy(d, PROMPT, 8, eos_token_id=r.token_ids[2])
    assert stopped.token_ids == r.token_ids[:3]
