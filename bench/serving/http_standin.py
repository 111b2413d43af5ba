"""A stand-in for ``router.service.Service`` in front of the router's real HTTP app: no workers,
no model. Every request's prompt is ``[1, 2, 3]``; :meth:`StandinService.generate` streams
``max_tokens`` one-token deltas (text ``" t<i>"``, token id ``i``), ``gap_s`` apart. Used by
``bench/serving/router_http.py`` (the HTTP layer's CPU per request) and by the HTTP tests, which
subclass it to hold or record deltas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from kvrelay.engine.outputs import FinishReason
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.router.admission import Admission
from kvrelay.router.errors import RouterError
from kvrelay.router.lifecycle import GenerateSpec
from kvrelay.router.outputs import Delta, Usage

T = TypeVar("T")


class _Registry:
    def can_serve(self) -> bool:
        return True


class _Lifecycle:
    registry = _Registry()


class StandinService:
    """What the HTTP app calls on a service, answering from memory (see the module)."""

    model_name = "demo"
    tokenizer = None
    token_strings = None  # no logprobs here: nothing to name
    lifecycle = _Lifecycle()
    cache_salt_by_api_key = False

    max_inflight = 512
    max_body_values = 1 << 20

    def __init__(self, gap_s: float = 0.0) -> None:
        self.gap_s = gap_s
        self.admission = Admission()  # the router's own bounds on work before parsing

    def effective_max_model_len(self) -> int:
        return 4096

    def tenant_of(self, api_key: str | None) -> str:
        return ""

    def arrival_refusal(self, tenant: str, priority: int | None = None) -> RouterError | None:
        return None

    async def offload(self, large: bool, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return fn(*args, **kw)

    async def build_spec(self, *, request_id: str | None, sampling: SamplingParams,
                         **kw: Any) -> GenerateSpec:
        return GenerateSpec(request_id or "r", [1, 2, 3], sampling)

    @staticmethod
    def delta(spec: GenerateSpec, i: int) -> Delta:
        """The ``i``-th one-token delta of ``spec``'s stream (the last one finishes it)."""
        n = spec.sampling.max_tokens
        last = i == n - 1
        return Delta(spec.request_id, f" t{i}", [i], [None], finished=last,
                     finish_reason=FinishReason.LENGTH if last else None,
                     usage=Usage(3, n) if last else None, done=last)

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Delta]:
        for i in range(spec.sampling.max_tokens):
            yield self.delta(spec, i)
            await asyncio.sleep(self.gap_s)
