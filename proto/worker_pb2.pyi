from kvrelay.proto import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_UNSPECIFIED: _ClassVar[FailureKind]
    FAILURE_DRAINING: _ClassVar[FailureKind]
    FAILURE_KV_DESTINATION: _ClassVar[FailureKind]
    FAILURE_OVERLOADED: _ClassVar[FailureKind]
    FAILURE_LEASE_GIVEN_UP: _ClassVar[FailureKind]
    FAILURE_REQUEST_ID_IN_USE: _ClassVar[FailureKind]
    FAILURE_ENGINE: _ClassVar[FailureKind]
    FAILURE_INVALID_REQUEST: _ClassVar[FailureKind]

class PullOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULL_NONE: _ClassVar[PullOutcome]
    PULL_DONE: _ClassVar[PullOutcome]
    PULL_NOT_NEEDED: _ClassVar[PullOutcome]
    PULL_SOURCE_FAILED: _ClassVar[PullOutcome]
    PULL_SOURCE_SHORT: _ClassVar[PullOutcome]
    PULL_NO_ROOM: _ClassVar[PullOutcome]
    PULL_READ_FAILED: _ClassVar[PullOutcome]
    PULL_NOT_HELD: _ClassVar[PullOutcome]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role
FAILURE_UNSPECIFIED: FailureKind
FAILURE_DRAINING: FailureKind
FAILURE_KV_DESTINATION: FailureKind
FAILURE_OVERLOADED: FailureKind
FAILURE_LEASE_GIVEN_UP: FailureKind
FAILURE_REQUEST_ID_IN_USE: FailureKind
FAILURE_ENGINE: FailureKind
FAILURE_INVALID_REQUEST: FailureKind
PULL_NONE: PullOutcome
PULL_DONE: PullOutcome
PULL_NOT_NEEDED: PullOutcome
PULL_SOURCE_FAILED: PullOutcome
PULL_SOURCE_SHORT: PullOutcome
PULL_NO_ROOM: PullOutcome
PULL_READ_FAILED: PullOutcome
PULL_NOT_HELD: PullOutcome

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "load", "last_seen_ms_ago")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: WorkerLoad
    last_seen_ms_ago: float
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., last_seen_ms_ago: _Optional[float] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_blocks", "free_blocks", "running", "waiting", "waiting_for_kv", "queued_prompt_tokens", "prefix_cache_queries", "prefix_cache_hits", "step_tokens_per_s", "draining", "step_cost", "tiers")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STEP_COST_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    free_blocks: int
    running: int
    waiting: int
    waiting_for_kv: int
    queued_prompt_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    step_tokens_per_s: float
    draining: bool
    step_cost: StepCost
    tiers: _containers.RepeatedCompositeFieldContainer[TierLoad]
    def __init__(self, num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., waiting_for_kv: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., step_tokens_per_s: _Optional[float] = ..., draining: _Optional[bool] = ..., step_cost: _Optional[_Union[StepCost, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierLoad, _Mapping]]] = ...) -> None: ...

class TierLoad(_message.Message):
    __slots__ = ("medium", "capacity_blocks", "used_blocks", "hit_blocks", "load_seconds_per_block", "load_failures", "stored_blocks", "loaded_bytes", "evicted_blocks")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    medium: str
    capacity_blocks: int
    used_blocks: int
    hit_blocks: int
    load_seconds_per_block: float
    load_failures: int
    stored_blocks: int
    loaded_bytes: int
    evicted_blocks: int
    def __init__(self, medium: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., load_seconds_per_block: _Optional[float] = ..., load_failures: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., evicted_blocks: _Optional[int] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("base", "prefill_token", "attended_pair", "decode", "decode_ctx_token", "prefill_chunk", "samples", "step_tokens")
    BASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTENDED_PAIR_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_CTX_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    base: float
    prefill_token: float
    attended_pair: float
    decode: float
    decode_ctx_token: float
    prefill_chunk: float
    samples: int
    step_tokens: int
    def __init__(self, base: _Optional[float] = ..., prefill_token: _Optional[float] = ..., attended_pair: _Optional[float] = ..., decode: _Optional[float] = ..., decode_ctx_token: _Optional[float] = ..., prefill_chunk: _Optional[float] = ..., samples: _Optional[int] = ..., step_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "incarnation", "model_identity", "block_size", "max_model_len", "drain_timeout_s", "kv_layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    address: str
    incarnation: str
    model_identity: str
    block_size: int
    max_model_len: int
    drain_timeout_s: float
    kv_layout: CacheLayout
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., model_identity: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., drain_timeout_s: _Optional[float] = ..., kv_layout: _Optional[_Union[CacheLayout, _Mapping]] = ...) -> None: ...

class CacheLayout(_message.Message):
    __slots__ = ("version", "kv_dtype", "hash_scheme", "hash_probe", "kv_kind", "block_order", "kv_pages")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    HASH_PROBE_FIELD_NUMBER: _ClassVar[int]
    KV_KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ORDER_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    version: int
    kv_dtype: str
    hash_scheme: str
    hash_probe: int
    kv_kind: str
    block_order: str
    kv_pages: str
    def __init__(self, version: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., hash_scheme: _Optional[str] = ..., hash_probe: _Optional[int] = ..., kv_kind: _Optional[str] = ..., block_order: _Optional[str] = ..., kv_pages: _Optional[str] = ...) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("medium", "added", "removed", "full")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    medium: str
    added: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    full: bool
    def __init__(self, medium: _Optional[str] = ..., added: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., full: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker", "load", "leaving", "tiers")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    load: WorkerLoad
    leaving: bool
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., leaving: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("interval_s", "want_full_block_set", "live_prefill_agents")
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    WANT_FULL_BLOCK_SET_FIELD_NUMBER: _ClassVar[int]
    LIVE_PREFILL_AGENTS_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    want_full_block_set: bool
    live_prefill_agents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, interval_s: _Optional[float] = ..., want_full_block_set: _Optional[bool] = ..., live_prefill_agents: _Optional[_Iterable[str]] = ...) -> None: ...

class ExportPrefixRequest(_message.Message):
    __slots__ = ("share_id", "prompt_token_ids", "cache_salt", "ttl_ms")
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    share_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    ttl_ms: int
    def __init__(self, share_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ExportPrefixResponse(_message.Message):
    __slots__ = ("block_ids", "tokens_covered", "peer_info", "agent_name", "incarnation", "page_ids")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COVERED_FIELD_NUMBER: _ClassVar[int]
    PEER_INFO_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens_covered: int
    peer_info: bytes
    agent_name: str
    incarnation: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., tokens_covered: _Optional[int] = ..., peer_info: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., incarnation: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EndExportRequest(_message.Message):
    __slots__ = ("share_id",)
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    share_id: str
    def __init__(self, share_id: _Optional[str] = ...) -> None: ...

class EndExportResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("in_flight",)
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    def __init__(self, in_flight: _Optional[int] = ...) -> None: ...

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class SessionOp(_message.Message):
    __slots__ = ("call", "decode", "generate_local", "cancel", "timeout_ms", "metadata")
    CALL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_LOCAL_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    call: int
    decode: DecodeRequest
    generate_local: LocalGenerateRequest
    cancel: bool
    timeout_ms: int
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, call: _Optional[int] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., generate_local: _Optional[_Union[LocalGenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[SessionOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[SessionOp, _Mapping]]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("call", "message", "status")
    CALL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    call: int
    message: DecodeResponse
    status: CallStatus
    def __init__(self, call: _Optional[int] = ..., message: _Optional[_Union[DecodeResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class TransferInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("peer_info", "incarnation")
    PEER_INFO_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    peer_info: bytes
    incarnation: str
    def __init__(self, peer_info: _Optional[bytes] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "ttl_ms", "sender_agent", "sender_address", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SENDER_AGENT_FIELD_NUMBER: _ClassVar[int]
    SENDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    sender_agent: str
    sender_address: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ..., sender_agent: _Optional[str] = ..., sender_address: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "block_ids", "cached_prefix_tokens", "agent_name", "incarnation", "ttl_ms", "page_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_prefix_tokens: int
    agent_name: str
    incarnation: str
    ttl_ms: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., cached_prefix_tokens: _Optional[int] = ..., agent_name: _Optional[str] = ..., incarnation: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "sender_agent", "sender_address", "writes_settled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_AGENT_FIELD_NUMBER: _ClassVar[int]
    SENDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WRITES_SETTLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    sender_agent: str
    sender_address: str
    writes_settled: bool
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., sender_agent: _Optional[str] = ..., sender_address: _Optional[str] = ..., writes_settled: _Optional[bool] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "first_token_id", "sampling", "kv_timeout_ms", "fork_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    FORK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    first_token_id: int
    sampling: _generate_pb2.SamplingParams
    kv_timeout_ms: int
    fork_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., kv_timeout_ms: _Optional[int] = ..., fork_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LocalGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "error", "cached_prompt_tokens", "kv_wait_ms", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finish_reason: _generate_pb2.FinishReason
    error: str
    cached_prompt_tokens: int
    kv_wait_ms: float
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., error: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_wait_ms: _Optional[float] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class FenceRequest(_message.Message):
    __slots__ = ("request_id", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class FenceResponse(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    def __init__(self, done: _Optional[bool] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("decode_address", "agent_name", "incarnation", "block_ids", "skip_prefix_tokens", "lease_id", "page_ids")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    agent_name: str
    incarnation: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_prefix_tokens: int
    lease_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, decode_address: _Optional[str] = ..., agent_name: _Optional[str] = ..., incarnation: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., skip_prefix_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "dest", "cache_salt", "destination_follows", "pull")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    dest: KVDestination
    cache_salt: str
    destination_follows: bool
    pull: PullHint
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., dest: _Optional[_Union[KVDestination, _Mapping]] = ..., cache_salt: _Optional[str] = ..., destination_follows: _Optional[bool] = ..., pull: _Optional[_Union[PullHint, _Mapping]] = ...) -> None: ...

class PullHint(_message.Message):
    __slots__ = ("source_address", "source_agent", "prefix_tokens", "timeout_ms")
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AGENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    source_address: str
    source_agent: str
    prefix_tokens: int
    timeout_ms: int
    def __init__(self, source_address: _Optional[str] = ..., source_agent: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PullResult(_message.Message):
    __slots__ = ("outcome", "pulled_tokens", "blocks_read", "bytes_read", "pull_ms")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    PULL_MS_FIELD_NUMBER: _ClassVar[int]
    outcome: PullOutcome
    pulled_tokens: int
    blocks_read: int
    bytes_read: int
    pull_ms: float
    def __init__(self, outcome: _Optional[_Union[PullOutcome, str]] = ..., pulled_tokens: _Optional[int] = ..., blocks_read: _Optional[int] = ..., bytes_read: _Optional[int] = ..., pull_ms: _Optional[float] = ...) -> None: ...

class SetDestinationRequest(_message.Message):
    __slots__ = ("request_id", "dest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dest: KVDestination
    def __init__(self, request_id: _Optional[str] = ..., dest: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class SetDestinationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "logprob", "cached_prompt_tokens", "queue_ms", "prefill_ms", "transfer_ms", "kv_bytes", "worker_id", "fork_token_ids", "fork_logprobs", "prompt_logprobs", "pull")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FORK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    logprob: _generate_pb2.TokenLogprob
    cached_prompt_tokens: int
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    kv_bytes: int
    worker_id: str
    fork_token_ids: _containers.RepeatedScalarFieldContainer[int]
    fork_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    pull: PullResult
    def __init__(self, first_token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., worker_id: _Optional[str] = ..., fork_token_ids: _Optional[_Iterable[int]] = ..., fork_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., pull: _Optional[_Union[PullResult, _Mapping]] = ...) -> None: ...
