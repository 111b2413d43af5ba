"""Shared engine core: model, paged KV cache, scheduler, sampler, tokenizer.

Both worker roles run this one engine. It knows nothing of gRPC, NIXL, Ray or roles beyond
configuration. Importing the package is cheap: heavy modules (torch) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "EngineConfig", "SamplingParams"]

if TYPE_CHECKING:
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.llm import LLM
    from kvrelay.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvrelay.engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from kvrelay.engine.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from kvrelay.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
