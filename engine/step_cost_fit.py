"""What one engine step costs, as fitted: the coefficients ``engine/step_cost.py`` fits online
from the engine's own steps, and what they predict.

This is the one model of step time in kvrelay. The engine's scheduler sizes prefill chunks with
it; the worker sends it in every heartbeat (``WorkerLoad.step_cost``), and the router's cost
model (``router/policy.py``) predicts prefill, local first-token and decode-step times from it
instead of fitting its own. Pure Python, no numpy or torch: the router imports it.

    t = base + prefill_token * P + attended_pair * A + decode * D + decode_ctx_token * K
          + prefill_chunk * C

with P prefill tokens, A (query, key) pairs those tokens attend over, D decodes, K keys the
decodes attend over and C prefill chunks in the step (``StepShape``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FEATURES = ("base", "prefill_token", "attended_pair", "decode", "decode_ctx_token",
            "prefill_chunk")


@dataclass(frozen=True)
class StepShape:
    """What a step did, in the units the model is fitted on."""

    prefill_tokens: int = 0
    attended_pairs: int = 0  # sum over prefill chunks of q_len x visible keys (causal)
    decodes: int = 0
    decode_ctx_tokens: int = 0  # keys the decodes attend over
    prefill_chunks: int = 0  # sequences with more than one token in the step

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), float(self.attended_pairs),
                float(self.decodes), float(self.decode_ctx_tokens), float(self.prefill_chunks))


@dataclass(frozen=True)
class StepCostFit:
    """Seconds per unit of each feature (see :data:`FEATURES`)."""

    base: float
    prefill_token: float
    attended_pair: float
    decode: float
    decode_ctx_token: float
    samples: int
    prefill_chunk: float = 0.0

    def predict(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self.as_tuple(), shape.features(), strict=True))

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(getattr(self, term) for term in FEATURES)

    def chunk_seconds(self, tokens: int, context: int) -> float:
        """What one prefill chunk of ``tokens`` over ``context`` cached tokens adds to a step."""
        pairs = tokens * context + tokens * (tokens + 1) // 2
        return self.prefill_chunk + self.prefill_token * tokens + self.attended_pair * pairs

    def prompt_seconds(self, tokens: int, step_tokens: int, *, queued: int = 0,
                       context: int = 0) -> float:
        """Seconds until a prompt's ``tokens`` (after ``context`` cached ones) are prefilled
        behind ``queued`` prompt tokens, in steps of at most ``step_tokens`` prefill tokens
        with no decodes beside them: each step's base cost, then each chunk's at its context.
        The queued tokens' prompts are not known here (nor their lengths): they count as fresh
        chunks of a step's size, so that a queue costs what its chunks would whichever terms
        of the fit carry a prompt's cost (a fit may put it all on attention and chunks, and
        priced per token alone a queue then cost nothing)."""
        if tokens <= 0 and queued <= 0:
            return 0.0
        step_tokens = max(1, step_tokens)
        steps = math.ceil((queued + max(0, tokens)) / step_tokens)
        full, rest = divmod(max(0, queued), step_tokens)
        queue = full * self.chunk_seconds(step_tokens, 0) \
            + (self.chunk_seconds(rest, 0) if rest else 0.0)
        return (steps * self.base + queue
                + self.prompt_compute_seconds(tokens, step_tokens, context=context))

    def prompt_compute_seconds(self, tokens: int, step_tokens: int, *,
                               context: int = 0) -> float:
        """What a prompt's ``tokens`` (after ``context`` cached ones) add to the steps that
        compute them, chunk by chunk: the time they take from decodes sharing those steps."""
        step_tokens = max(1, step_tokens)
        seconds, done = 0.0, 0
        while done < tokens:
            n = min(step_tokens, tokens - done)
            seconds += self.chunk_seconds(n, context + done)
            done += n
        return seconds

    def decode_step_seconds(self, batch: int, ctx_tokens: int) -> float:
        """A step decoding ``batch`` sequences that attend over ``ctx_tokens`` keys in all."""
        return self.base + self.decode * batch + self.decode_ctx_token * ctx_tokens
