"""Request bodies of the OpenAI-compatible API (pydantic), and their checks.

Fields kvrelay cannot honour (n > 16, best_of, suffix) are refused with a 400 that says
so, instead of being silently ignored. Penalties, logit_bias, min_tokens and allowed_token_ids are
range-checked here and again by SamplingParams (whose message the 400 carries).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvrelay.common.limits import (
    INT32_MAX,
    MAX_CHAT_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from kvrelay.engine.prefix_hash import MAX_CACHE_SALT
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured import StructuredOutput

MAX_HTTP_LOGPROBS = 20
MAX_BAD_WORDS = 128  # words; each becomes up to two token sequences (SamplingParams: 256)
MAX_BAD_WORD_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    # OpenAI: token id (a JSON object's keys are strings) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    allowed_token_ids: list[int] | None = None
    # vLLM's extension: words the output must not contain (tokenized by the router).
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    user: str | None = None
    request_id: str | None = None
    timeout_ms: int | None = Field(default=None, gt=0)
    # vLLM's extension: share cached prefix blocks only with requests of the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    # kvrelay extension: include the per-request trace in the final response/chunk.
    return_trace: bool = False
    # vLLM's: under overload lower values are served first and shed last (router.fairness).
    priority: int = Field(default=0, ge=-INT32_MAX - 1, le=INT32_MAX)
    # Structured output: OpenAI's response_format, or vLLM's guided_* (at most one of them).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: the backend is fixed

    def structured_output(self) -> StructuredOutput | None:
        """The grammar this request asks for; ValueError (a 400) for a malformed or refused
        one. Whether the grammar compiles is checked later, against the tokenizer."""
        if self.guided_grammar is not None:
            raise ValueError("guided_grammar is not supported (use response_format, "
                             "guided_json, guided_regex or guided_choice)")
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(StructuredOutput("json_object"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or "schema" not in js:
                    raise ValueError("response_format.json_schema must be an object with a "
                                     "'schema'")
                found.append(StructuredOutput.json_schema(js["schema"]))
            elif kind != "text":
                raise ValueError(f"response_format.type must be text, json_object or "
                                 f"json_schema, got {kind!r}")
        if self.guided_json is not None:
            found.append(StructuredOutput.json_schema(self.guided_json))
        if self.guided_regex is not None:
            found.append(StructuredOutput("regex", self.guided_regex))
        if self.guided_choice is not None:
            found.append(StructuredOutput("choice", choices=tuple(self.guided_choice)))
        if len(found) > 1:
            raise ValueError("give at most one of response_format (json_object/json_schema), "
                             "guided_json, guided_regex and guided_choice")
        return found[0] if found else None

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= SamplingParams.MAX_N:
            raise ValueError(f"n must be in [1, {SamplingParams.MAX_N}]")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        for w in v or []:
            if not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words entries must be 1 to {MAX_BAD_WORD_CHARS} "
                                 f"characters, not only spaces")
        return v

    def logit_bias_ids(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                out[int(k)] = v
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        return out

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_HTTP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (batches of prompts need n separate requests)."""
        p: Any = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(x, int) for x in p):
            return list(p)
        if isinstance(p, list) and len(p) == 1:
            return p[0] if isinstance(p[0], str) else list(p[0])
        raise ValueError("prompt must be one string or one list of token ids (batches of "
                         "prompts are not supported: send one request per prompt)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_HTTP_LOGPROBS)
    add_generation_prompt: bool = True
