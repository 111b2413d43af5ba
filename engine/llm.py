"""Offline API in the style of vLLM's ``LLM``: the engine, the tokenizer and stop strings in one
process, no servers.

    llm = LLM("path/to/checkpoint", kv_cache_memory="1GiB")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.detokenizer import OutputProcessor
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampler import TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import FinishReason
from kvrelay.engine.tokenizer import eos_token_ids, load_tokenizer

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | os.PathLike[str], **kwargs: Any):
        self._init(EngineConfig.from_kwargs(model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        self = cls.__new__(cls)
        self._init(config)
        return self

    def _init(self, config: EngineConfig) -> None:
        model_dir = config.model.model
        self.tokenizer = load_tokenizer(model_dir)
        self.engine = EngineCore(config, eos_token_ids=eos_token_ids(model_dir, self.tokenizer))
        self._ids = itertools.count()

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _run(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams]) \
            -> Iterator[tuple[CompletionOutput, str]]:
        """Yield ``(output, new_text)`` as tokens arrive, for every request."""
        outs: dict[str, CompletionOutput] = {}
        procs: dict[str, OutputProcessor] = {}
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                rid = f"llm-{next(self._ids)}"
                ids = self._tokenize(prompt)
                self.engine.add_request(rid, ids, sp)
                outs[rid] = CompletionOutput(rid, ids)
                procs[rid] = OutputProcessor(self.tokenizer, ids, sp)
            live = set(outs)
            while live:
                for o in self.engine.step():
                    if o.request_id not in live:
                        continue
                    out = outs[o.request_id]
                    out.token_ids += o.new_token_ids
                    out.logprobs += o.logprobs
                    out.num_cached_tokens = o.num_cached_tokens
                    step = procs[o.request_id].add(
                        o.new_token_ids, finished=o.finished,
                        stopped_on_token=o.finish_reason == FinishReason.STOP)
                    out.text += step.text
                    if step.stop_string is not None:
                        self.engine.abort(o.request_id)
                        out.finish_reason, out.stop_reason = FinishReason.STOP, step.stop_string
                    elif o.finished:
                        out.finish_reason = o.finish_reason
                        if o.finish_reason == FinishReason.STOP and out.token_ids:
                            out.stop_reason = out.token_ids[-1]
                    if out.finish_reason is not None:
                        live.discard(o.request_id)
                    yield out, step.text
        finally:
            for rid in outs:
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) \
            -> list[CompletionOutput]:
        """Generate for one prompt (a string or token ids) or a list of them; outputs keep the
        order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        sampling = sampling or SamplingParams()
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) \
            else list(sampling)
        results: dict[str, CompletionOutput] = {}
        for out, _ in self._run(prompts, params):
            results[out.request_id] = out
        return sorted(results.values(), key=lambda o: int(o.request_id.split("-")[1]))

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Iterator[str]:
        """Text of one prompt as it is generated."""
        for _, text in self._run([prompt], [sampling or SamplingParams()]):
            if text:
                yield text
