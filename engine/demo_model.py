"""A deterministic demo checkpoint: random-weight Llama plus a byte-level BPE tokenizer.

``write_demo_model(out_dir)`` writes a directory that transformers loads offline
(``AutoModelForCausalLM`` / ``AutoTokenizer``) and that kvrelay serves like any Hugging Face
checkpoint: ``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``
and ``tokenizer_config.json`` (with a chat template). The same size and seed always give
byte-identical files (for one transformers/tokenizers version), so no model hub is ever needed.

The tokenizer is trained on ``demo_corpus.txt`` shipped beside this module. That corpus supports
at most a few thousand tokens, so the "base" model pads its vocabulary past the tokenizer's (as
many released models do); the padded rows of the embedding and LM head are zero.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

logger = logging.getLogger(__name__)

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, *ROLE_TOKENS)  # ids 0..6, in this order
# The special token ids a config of a checkpoint with the demo tokenizer carries.
SPECIAL_IDS = {"bos_token_id": SPECIAL_TOKENS.index(BOS),
               "eos_token_id": SPECIAL_TOKENS.index(EOS),
               "pad_token_id": SPECIAL_TOKENS.index(PAD)}
TOKENIZER_VOCAB_SIZE = 4096

# <s><|user|>\n{content}</s>\n ... <|assistant|>\n ; an assistant turn ends with </s> (= EOS).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class DemoSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < TOKENIZER_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be at least {TOKENIZER_VOCAB_SIZE}")


DEMO_SIZES: dict[str, DemoSize] = {
    # ~7M parameters: `make serve`, the tests and the small benchmarks.
    "tiny": DemoSize(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4,
                     intermediate_size=768, vocab_size=4096),
    # ~150M parameters: benchmarks (a 32k vocabulary, like Llama 2, for a realistic LM head).
    "base": DemoSize(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                     intermediate_size=3072, vocab_size=32000),
}


# -- tokenizer ---------------------------------------------------------------------------------
def demo_corpus() -> str:
    """The plain-text corpus the demo tokenizer is trained on."""
    return resources.files("kvrelay.engine").joinpath("demo_corpus.txt").read_text("utf-8")


def train_demo_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Any:
    """Train the byte-level BPE ``tokenizers.Tokenizer`` (deterministic) on the demo corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    paragraphs = demo_corpus().split("\n\n")
    tok.train_from_iterator(paragraphs, trainer, length=len(paragraphs))
    got = tok.get_vocab_size()
    if got != vocab_size:
        raise ValueError(f"the demo corpus supports only {got} tokens, {vocab_size} were asked")
    return tok


def write_demo_tokenizer(out_dir: str, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` in the form real checkpoints use."""
    os.makedirs(out_dir, exist_ok=True)
    tok = train_demo_tokenizer(vocab_size)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ROLE_TOKENS),
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": max(s.max_position_embeddings for s in DEMO_SIZES.values()),
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)


# -- weights -----------------------------------------------------------------------------------
@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int, *, gain: float = 1.0,
                        embed_std: float = 1.0, norm_jitter: float = 0.0,
                        bias_std: float = 0.0, used_vocab: int | None = None) -> None:
    """Fill every parameter from a private generator (the global RNG is untouched).

    Matrices get N(0, gain**2 / fan_in), embeddings N(0, embed_std**2), norm weights
    1 + U(-norm_jitter, norm_jitter), biases N(0, bias_std**2). Larger gains make a random
    model's greedy output less repetitive (with tied embeddings, a smaller ``embed_std`` keeps it
    from repeating its input). Rows of the embedding and LM head at or past ``used_vocab`` are
    zeroed (a padded vocabulary).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if "norm" in name and p.ndim == 1:
            noise = torch.rand(p.shape, generator=gen, dtype=torch.float32) * 2 - 1
            p.copy_(1.0 + norm_jitter * noise)
        elif p.ndim == 1:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * bias_std)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * embed_std)
        else:
            std = gain / p.shape[1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        if used_vocab is not None and ("embed_tokens" in name or "lm_head" in name):
            p[used_vocab:] = 0.0


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars for the duration (they write to stderr)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def demo_config(size: str = "tiny") -> Any:
    """The ``transformers.LlamaConfig`` of the demo model of ``size``."""
    from transformers import LlamaConfig

    if size not in DEMO_SIZES:
        raise ValueError(f"unknown demo model size {size!r}; choose one of {sorted(DEMO_SIZES)}")
    s = DEMO_SIZES[size]
    config = LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads, head_dim=s.hidden_size // s.num_heads,
        max_position_embeddings=s.max_position_embeddings, rms_norm_eps=1e-5,
        rope_theta=s.rope_theta, tie_word_embeddings=False, **SPECIAL_IDS)
    config.architectures = ["LlamaForCausalLM"]
    return config


DEMO_DTYPES = ("bfloat16", "float32")


def write_demo_model(out_dir: str, size: str = "tiny", seed: int = 0,
                     dtype: str = "bfloat16") -> str:
    """Write the demo checkpoint of ``size`` ("tiny" or "base") to ``out_dir``; returns it.
    Its weights are written in ``dtype``: bf16 by default, as real checkpoints are (the
    weights are drawn in fp32 and rounded once, so the fp32 and bf16 demo models of a seed
    differ only by that rounding)."""
    from transformers import LlamaForCausalLM

    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if dtype not in DEMO_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DEMO_DTYPES)}, got {dtype!r}")
    config = demo_config(size)
    n_params = save_random_checkpoint(LlamaForCausalLM, config, out_dir, seed, dtype)
    logger.info("wrote the %s demo model (%.1fM parameters, %s, seed %d) to %s",
                size, n_params / 1e6, dtype, seed, out_dir)
    return out_dir


def save_random_checkpoint(model_class: Any, config: Any, out_dir: str, seed: int,
                           dtype: str, used_vocab: int | None = TOKENIZER_VOCAB_SIZE) -> int:
    """Build ``model_class(config)`` (a transformers causal LM), give it the demo's random
    weights of ``seed`` (drawn in fp32, rounded once to ``dtype``; embedding rows from
    ``used_vocab`` on zeroed, None: none), and save it to ``out_dir`` as a checkpoint directory
    with the demo tokenizer, its ``architectures`` the class's; returns its parameter count. The
    config carries the special token ids (``SPECIAL_IDS``)."""
    from transformers import GenerationConfig

    config.architectures = [model_class.__name__]
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = model_class(config)
    init_random_weights(model, seed, gain=1.5, norm_jitter=0.2, used_vocab=used_vocab)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    model.to(getattr(torch, dtype))  # config.json then says so too
    os.makedirs(out_dir, exist_ok=True)
    with quiet_transformers():
        model.save_pretrained(out_dir, safe_serialization=True)
    write_demo_tokenizer(out_dir)
    return sum(p.numel() for p in model.parameters())


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
