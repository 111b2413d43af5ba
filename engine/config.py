"""Engine configuration: one frozen dataclass per component, validated on construction."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[str, ...] = ("both", "prefill", "decode")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(value: str | int) -> int:
    """'512MiB', '2G', '1048576' -> bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"cannot parse a byte size from {value!r} (examples: 512MiB, 2GiB, 1e9)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


THREAD_BINDINGS = ("auto", "on", "off")  # where the engine threads run: engine.cpu.thread_pinning
DTYPES = ("auto", "float32", "bfloat16", "float16")  # the weights' (ModelConfig.dtype)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
HYBRID_KV = ("auto", "off")  # CacheConfig.hybrid_kv
KV_LAYOUTS = ("auto", "tokens", "heads")  # CacheConfig.kv_layout
# The KV cache's size on the CPU when --kv-cache-memory is not given (a GPU's cache takes what
# --gpu-memory-utilization leaves after the largest step instead).
DEFAULT_KV_BYTES = 512 * 2**20


@dataclass(frozen=True)
class ModelConfig:
    model: str  # checkpoint directory (config.json + *.safetensors)
    # The weights' dtype. auto: the checkpoint's (config.json's dtype/torch_dtype) where the
    # device has kernels for it: bf16 stays bf16 on CPU and GPU; fp32 (or unstated) runs fp32 on
    # CPU and bf16 on CUDA. On CPU the activations stay fp32 whatever this is (Platform).
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    attention_backend: Literal["auto", "native", "sdpa", "flash"] = "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU
    seed: int = 0
    # CPU fp32 linears: "panels" (the native panel GEMM), "onednn" (oneDNN's prepacked linear),
    # "mixed" (panels up to 64 rows, oneDNN above; two weight copies) or "auto": time both at
    # load and keep what wins on this CPU (see engine.cpu.kernel_choice).
    linear_kernel: str = "auto"
    # Ranks of one replica (one process each; see engine.tensor_parallel) and how long any of
    # their collectives may wait before the replica fails with TensorParallelError.
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0
    # CUDA graphs for decode-only steps (engine.cuda.graphs): batches up to this many sequences
    # replay graphs captured at start; enforce_eager (or 0) keeps every step eager. CUDA only.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 64
    # Serving on CPU: pin the engine's OpenMP threads one per CPU (engine.cpu.thread_pinning):
    # "auto" where the process has exactly as many CPUs as threads, "on", or "off".
    thread_binding: str = "auto"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("ModelConfig.model must name a checkpoint directory")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {'|'.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.attention_backend not in ("auto", "native", "sdpa", "flash"):
            raise ValueError(f"attention_backend must be auto|native|sdpa|flash, got "
                             f"{self.attention_backend!r}")
        if self.linear_kernel not in ("auto", "panels", "onednn", "mixed"):
            raise ValueError(f"linear_kernel must be auto|panels|onednn|mixed, got "
                             f"{self.linear_kernel!r}")
        if self.thread_binding not in THREAD_BINDINGS:
            raise ValueError(f"thread_binding must be auto|on|off, got {self.thread_binding!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got "
                             f"{self.tensor_parallel_size}")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if not self.tp_timeout_s > 0:
            raise ValueError(f"tp_timeout_s must be positive, got {self.tp_timeout_s}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for the KV tensor. None: on a GPU what --gpu-memory-utilization leaves once the
    # largest step has run (measured at start), on the CPU DEFAULT_KV_BYTES.
    kv_cache_memory: int | None = None
    num_blocks: int | None = None  # overrides the memory budget when set
    # On CUDA the KV budget also stays within this fraction of the GPU's memory (after weights).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Keep the KV heads in this many groups, each a tensor of its own (see engine/kv_cache.py).
    kv_head_groups: int = 1
    # What the KV cache stores (and KV transfer moves). auto: the weights' dtype, so a bf16
    # checkpoint keeps bf16 KV (half the bytes per token held and sent).
    kv_cache_dtype: str = "auto"
    # The tiers below the pool (engine/tiers): a host tier of this many bytes (0: none), and
    # below it, with a directory, a disk tier of ``kv_offload_disk`` bytes.
    kv_offload_memory: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk: int = 4 * 2**30
    # Keep the disk tier's files across restarts (``engine/tiers/disk_files.py``).
    kv_offload_keep: bool = False
    # Per-layer-group pages for a model whose layers differ in window (engine/hybrid_kv.py):
    # auto: for such a model (Gemma 3, gpt-oss) the windowed layers' pages of the blocks behind
    # the window are let go (idle until the pool needs them); off: one block table for every
    # layer (each block held while any layer reads it). P/D handoffs and prefix pulls address
    # pages (both pools of a deployment must agree). A model whose layers share one window (or
    # none) keeps one table either way.
    hybrid_kv: str = "auto"
    # Inside a block: tokens: each token's heads together ([block_size, heads, head_dim], what
    # the CPU kernels read); heads: each head's tokens together ([heads, block_size, head_dim]),
    # so a peer of another tensor-parallel split reads or writes a contiguous run of heads per
    # block (no staging, no KV head groups); flash-attn and SDPA read it through a strided view.
    # auto: heads on CUDA, tokens on CPU. Both pools of a P/D deployment must agree.
    kv_layout: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_head_groups < 1:
            raise ValueError(f"kv_head_groups must be positive, got {self.kv_head_groups}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {'|'.join(KV_LAYOUTS)}, got "
                             f"{self.kv_layout!r}")
        if self.hybrid_kv not in HYBRID_KV:
            raise ValueError(f"hybrid_kv must be one of {'|'.join(HYBRID_KV)}, got "
                             f"{self.hybrid_kv!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {'|'.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
            if self.kv_cache_memory <= 0:
                raise ValueError("kv_cache_memory must be positive")
        for name in ("kv_offload_memory", "kv_offload_disk"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name)))
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.kv_offload_dir is not None and not self.kv_offload_memory:
            raise ValueError("a disk tier (kv_offload_dir) sits below the host tier: it needs "
                             "kv_offload_memory too")
        if self.kv_offload_keep and self.kv_offload_dir is None:
            raise ValueError("kv_offload_keep keeps the disk tier: it needs kv_offload_dir")
        if self.kv_offload_memory and not self.enable_prefix_caching:
            raise ValueError("KV offload tiers keep prefix-cache blocks: they need prefix caching")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 128  # sequences in one step
    enable_chunked_prefill: bool = True
    # Prompts longer than this are "long": at most one of them is prefilling at a time and short
    # prompts go first within a step's budget, so a long prompt cannot block the queue.
    long_prefill_threshold: int | None = None  # default: max_num_batched_tokens // 4
    max_waiting: int = 1024  # admission control: add_request beyond this raises EngineOverloaded
    # Time-per-output-token target: a step carrying decodes takes only as many prefill tokens
    # as an online fit of step time says fit within it (engine/step_cost.py). None: the fixed
    # token budget above.
    tpot_slo_ms: float | None = None
    # Inter-token latency cap: no step that carries decodes is planned past it (Sarathi-
    # Serve's per-iteration cap). Unlike the TPOT target, a mean over a request's tokens that
    # lets a step spend the slack earlier steps left, this bounds every step: the ITL tail.
    itl_cap_ms: float | None = None
    # The cap yields (only the TPOT target then limits the step) in a step whose oldest queued
    # prompt has waited this long: under load a capped step would cap prefill throughput too,
    # and the queue (TTFT, goodput) would pay for the ITL tail. inf: never.
    itl_cap_max_queue_ms: float = 250.0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be positive")
        if self.long_prefill_threshold is None:
            object.__setattr__(self, "long_prefill_threshold",
                               max(1, self.max_num_batched_tokens // 4))
        if self.long_prefill_threshold < 1:
            raise ValueError("long_prefill_threshold must be positive")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be positive")
        for name in ("tpot_slo_ms", "itl_cap_ms"):
            ms = getattr(self, name)
            if ms is not None and not (0 < ms < 3_600_000):
                raise ValueError(f"{name} must be a positive number of milliseconds, got {ms}")
        if not self.itl_cap_max_queue_ms >= 0:
            raise ValueError("itl_cap_max_queue_ms must be a number of milliseconds >= 0 "
                             f"(inf: the cap never yields), got {self.itl_cap_max_queue_ms}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    role: Role = "both"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike[str], **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments (vLLM's ``LLM(model, **kw)`` style) into component configs."""
        parts: dict[type, dict[str, Any]] = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
        role = kwargs.pop("role", "both")
        for key, value in kwargs.items():
            for comp in parts:
                if key in {f.name for f in dataclasses.fields(comp)}:
                    parts[comp][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(
            model=ModelConfig(model=os.fspath(model), **parts[ModelConfig]),
            cache=CacheConfig(**parts[CacheConfig]),
            scheduler=SchedulerConfig(**parts[SchedulerConfig]),
            role=role,
        )
