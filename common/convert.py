"""Protobuf <-> engine dataclasses, done once at the edge. Bad values raise ValueError with a
message fit for the client (servicers turn it into INVALID_ARGUMENT)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from kvrelay.common.limits import MAX_ATTEMPT_ID, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from kvrelay.engine.outputs import FinishReason, TokenLogprob
from kvrelay.engine.prefix_hash import MAX_CACHE_SALT
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.step_cost_fit import FEATURES, StepCostFit
from kvrelay.engine.structured import StructuredOutput
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import worker_pb2 as wpb

DEFAULT_MAX_TOKENS = 16
# How long a worker waits for a torn-down attempt of a request id to let go of it before it
# refuses the id as in use.
ID_REUSE_WAIT_S = 3.0


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_ATTEMPT_ID:
        raise ValueError(f"request_id must be 1..{MAX_ATTEMPT_ID} characters")


def cache_salt_of(salt: str) -> str | None:
    if len(salt) > MAX_CACHE_SALT:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT} characters")
    return salt or None

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_BACK = {v: k for k, v in _FINISH.items()}


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    # Counted before anything is copied: the lists are as long as the message allows.
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    kw: dict = {
        "max_tokens": msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        "stop": tuple(msg.stop),
        "stop_token_ids": msg.stop_token_ids,
        "ignore_eos": msg.ignore_eos,
        "include_stop_str_in_output": msg.include_stop_str_in_output,
    }
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs", "skip_special_tokens"):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    if len(msg.logit_bias) > SamplingParams.MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {SamplingParams.MAX_LOGIT_BIAS} tokens")
    if len(msg.allowed_token_ids) > SamplingParams.MAX_ALLOWED_TOKEN_IDS:
        raise ValueError(f"at most {SamplingParams.MAX_ALLOWED_TOKEN_IDS} allowed_token_ids")
    kw["logit_bias"] = dict(msg.logit_bias)
    kw["min_tokens"] = msg.min_tokens
    kw["resumed_output_tokens"] = msg.resumed_output_tokens
    if msg.HasField("n"):
        kw["n"] = msg.n
    if msg.HasField("prompt_logprobs"):
        kw["prompt_logprobs"] = msg.prompt_logprobs
    if msg.allowed_token_ids:
        kw["allowed_token_ids"] = msg.allowed_token_ids
    if len(msg.bad_words) > SamplingParams.MAX_BAD_WORDS:
        raise ValueError(f"at most {SamplingParams.MAX_BAD_WORDS} bad words (token sequences)")
    if msg.bad_words:
        kw["bad_words_token_ids"] = tuple(tuple(w.ids) for w in msg.bad_words)
    if kw.get("top_k") == -1:
        kw["top_k"] = 0
    if msg.HasField("structured"):
        kw["structured"] = structured_from_proto(msg.structured)
    return SamplingParams(**kw)


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("kind")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind in ("json_schema", "regex"):
        return StructuredOutput(kind, getattr(msg, kind))
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.choices))
    raise ValueError("structured output needs one of json_object, json_schema, regex, choice")


def structured_to_proto(so: StructuredOutput) -> pb.StructuredOutput:
    if so.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if so.kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(so.choices)))
    return pb.StructuredOutput(**{so.kind: so.spec})


def sampling_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_tokens=sp.max_tokens,
        stop=list(sp.stop), stop_token_ids=sorted(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.presence_penalty:
        msg.presence_penalty = sp.presence_penalty
    if sp.frequency_penalty:
        msg.frequency_penalty = sp.frequency_penalty
    if sp.repetition_penalty != 1.0:
        msg.repetition_penalty = sp.repetition_penalty
    for tok, bias in sp.logit_bias:
        msg.logit_bias[tok] = bias
    msg.min_tokens = sp.min_tokens
    msg.resumed_output_tokens = sp.resumed_output_tokens
    if sp.n != 1:
        msg.n = sp.n
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = sp.prompt_logprobs
    if sp.allowed_token_ids is not None:
        msg.allowed_token_ids.extend(sorted(sp.allowed_token_ids))
    for w in sp.bad_words_token_ids:
        msg.bad_words.add(ids=w)
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    if sp.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(sp.structured))
    return msg


def finish_to_proto(reason: FinishReason | None) -> int:
    return _FINISH[reason]


def finish_from_proto(value: int) -> FinishReason | None:
    return _FINISH_BACK.get(value)


def logprob_to_proto(lp: TokenLogprob | None) -> pb.TokenLogprob:
    if lp is None:
        return pb.TokenLogprob()
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top])


def metadata_to_proto(md: Iterable[tuple[str, Any]]) -> list[wpb.MetadataEntry]:
    return [wpb.MetadataEntry(key=k, value=str(v)) for k, v in md]


def metadata_from_proto(entries: Iterable[wpb.MetadataEntry]) -> tuple[tuple[str, str], ...]:
    return tuple((e.key, e.value) for e in entries)


def step_cost_to_proto(fit: StepCostFit | None, step_tokens: int) -> wpb.StepCost | None:
    """The engine's fitted step time for a heartbeat (None until it has one)."""
    if fit is None:
        return None
    return wpb.StepCost(**{term: getattr(fit, term) for term in FEATURES},
                        samples=fit.samples, step_tokens=step_tokens)


def step_cost_from_proto(msg: wpb.StepCost) -> tuple[StepCostFit, int] | None:
    """A beat's step-time fit and the engine's step token budget; None when the beat has none
    (or one that no step could have produced: a negative or non-finite term)."""
    if msg.samples == 0 or msg.step_tokens == 0:
        return None
    terms = {term: getattr(msg, term) for term in FEATURES}
    if not all(math.isfinite(v) and 0.0 <= v < 3600.0 for v in terms.values()):
        return None
    return StepCostFit(**terms, samples=msg.samples), msg.step_tokens
