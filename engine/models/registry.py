"""Which model class runs each architecture family (``ModelArch.family``).

A model class is an ``nn.Module`` built by ``from_config`` over the paged KV cache, with the
interface the engine drives (``bind_kv_cache``, ``forward``, ``compute_logits``) and
``checkpoint_targets`` for the loader. Every family of the Llama decoder (Llama, Mistral, Qwen2,
Qwen3, and Mixtral and Qwen3-MoE with their experts) is ``LlamaForCausalLM``; a family with a
decoder of its own registers its class here.
"""

from __future__ import annotations

from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.deepseek import DeepseekForCausalLM
from kvrelay.engine.models.gemma3 import Gemma3ForCausalLM
from kvrelay.engine.models.gpt_oss import GptOssForCausalLM
from kvrelay.engine.models.llama import LlamaForCausalLM
from kvrelay.engine.models.phi3 import Phi3ForCausalLM

MODEL_CLASSES: dict[str, type] = {
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
}


def model_class(arch: ModelArch) -> type:
    """The class that runs ``arch`` (``LlamaForCausalLM`` unless its family registers one)."""
    return MODEL_CLASSES.get(arch.family, LlamaForCausalLM)
