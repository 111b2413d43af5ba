"""Command-line options shared by every kvrelay process and by the deploy tools: each option's
default can come from a ``KVRELAY_<FLAG>`` environment variable (how the Kubernetes manifests and
the Ray launcher configure processes), and the engine's options map onto one ``EngineConfig``."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVRELAY_"
PLACEHOLDER_MARK = "CHANGE-ME"  # in every example and demo secret the repository ships


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _truthy(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


def opt(p: argparse.ArgumentParser | Any, flag: str, *, env: bool = True, **kw: Any) -> None:
    """``add_argument`` whose default comes from ``KVRELAY_<FLAG>`` when that is set."""
    name = env_name(flag)
    if env and name in os.environ:
        raw = os.environ[name]
        if kw.get("action") == "store_true":
            kw["default"] = _truthy(raw)
        elif kw.get("action") == "append":
            kw["default"] = [x for x in raw.split(",") if x]
        else:
            kw["default"] = raw
    if env:
        kw["help"] = (kw.get("help") or "") + f" [env {name}]"
    p.add_argument(flag, **kw)


# -- option groups --------------------------------------------------------------------------
def add_engine_options(p: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    from kvrelay.engine.config import (  # stdlib only: cheap to import
        DTYPES,
        HYBRID_KV,
        KV_CACHE_DTYPES,
        KV_LAYOUTS,
        THREAD_BINDINGS,
    )

    g = p.add_argument_group("engine")
    opt(g, "--model", required=model_required and env_name("--model") not in os.environ,
        help="checkpoint directory (config.json + *.safetensors + tokenizer)")
    opt(g, "--dtype", default="auto", choices=list(DTYPES),
        help="the weights' dtype; auto: the checkpoint's where the device has kernels for it "
             "(bf16 checkpoints run bf16 on CPU and GPU; on CPU the activations stay fp32)")
    opt(g, "--device", default="auto", help="auto|cpu|cuda|cuda:N")
    opt(g, "--max-model-len", type=int, default=None)
    opt(g, "--block-size", type=int, default=16, help="tokens per KV block")
    opt(g, "--kv-cache-memory", default=None,
        help="KV cache budget (e.g. 512MiB, 4GiB). Default: on a GPU what "
             "--gpu-memory-utilization leaves once the largest step has run (measured at "
             "start), on the CPU 512MiB")
    opt(g, "--gpu-memory-utilization", type=float, default=0.9,
        help="on CUDA the KV cache also stays within this fraction of the GPU's memory")
    opt(g, "--num-kv-blocks", type=int, default=None, help="exact KV blocks (overrides budget)")
    opt(g, "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="what the KV cache stores and KV transfer moves; auto: the weights' dtype (both "
             "pools of a deployment must agree)")
    opt(g, "--no-prefix-caching", action="store_true", help="disable the prefix cache")
    opt(g, "--hybrid-kv", default="auto", choices=list(HYBRID_KV),
        help="auto: a model whose layers differ in window (Gemma 3, gpt-oss) keeps a page table "
             "per layer group and lets its windowed layers' pages behind the window go as it "
             "decodes (kept until the pool needs them); off: one block table for every layer. "
             "Both pools of a P/D deployment must agree")
    opt(g, "--kv-layout", default="auto", choices=list(KV_LAYOUTS),
        help="inside a KV block, tokens: each token's heads together (what the CPU kernels "
             "read); heads: each head's tokens together, so a peer of another tensor-parallel "
             "split moves a contiguous run of heads per block (flash-attn and SDPA read it; on "
             "CPU with --attention-backend sdpa). auto: heads on CUDA, tokens on CPU. Both pools "
             "of a P/D deployment must agree")
    opt(g, "--kv-offload-memory", default="0",
        help="a host tier below the KV pool of this size (e.g. 8GiB; 0: none): blocks the pool "
             "evicts stay here and come back on a prefix hit instead of being recomputed "
             "(pinned host memory on a GPU; on a CPU worker make it several times the pool)")
    opt(g, "--kv-offload-dir", default=None,
        help="a disk tier below the host tier, in this directory (a local disk, or /dev/shm "
             "for a tier in shared memory; files of an earlier run are removed at start "
             "unless --kv-offload-keep)")
    opt(g, "--kv-offload-disk", default="4GiB", help="the disk tier's size")
    opt(g, "--kv-offload-keep", action="store_true",
        help="keep the disk tier's blocks across restarts: a worker starting on a directory an "
             "earlier one left (same model and KV layout) serves its blocks again, each "
             "checked on load, and leaves its own at exit")
    opt(g, "--kv-head-groups", type=int, default=1,
        help="keep the KV heads (each rank's) in this many groups, laid out as the ranks of a "
             "replica of this many times our TP size lay them out: KV then moves to or from "
             "such a replica rank to rank (on the workers of the smaller TP size: the ratio)")
    opt(g, "--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    opt(g, "--max-num-seqs", type=int, default=128)
    opt(g, "--no-chunked-prefill", action="store_true", help="prefill whole prompts only")
    opt(g, "--long-prefill-threshold", type=int, default=None,
        help="prompts longer than this are chunked one at a time (default budget/4)")
    opt(g, "--max-waiting", type=int, default=1024, help="queued requests before refusing")
    opt(g, "--tpot-slo-ms", type=float, default=None,
        help="time-per-output-token target: a step with decodes carries only the prefill tokens "
             "a fitted step-time model says keep it within this (default: fixed budget)")
    opt(g, "--itl-cap-ms", type=float, default=None,
        help="inter-token latency cap: no step with decodes is planned longer than this "
             "(bounds every step, at a cost in TTFT; --tpot-slo-ms bounds their mean)")
    opt(g, "--itl-cap-max-queue-ms", type=float, default=250.0,
        help="the ITL cap yields in steps whose oldest queued prompt has waited this long, so "
             "the queue drains at full speed under load (inf: never)")
    opt(g, "--num-threads", type=int, default=None,
        help="torch threads on CPU (per rank; default 1 per rank under tensor parallelism)")
    opt(g, "--thread-binding", default="auto", choices=list(THREAD_BINDINGS),
        help="pin the engine's CPU threads one per core: auto does where the process may run "
             "on exactly --num-threads CPUs (taskset, cpuset)")
    opt(g, "--tensor-parallel-size", type=int, default=1,
        help="ranks of one replica, one process each (heads and MLP columns split over them)")
    opt(g, "--tp-timeout-s", type=float, default=60.0,
        help="longest wait of a tensor-parallel collective before the replica fails")
    opt(g, "--attention-backend", default="auto", choices=["auto", "native", "sdpa", "flash"])
    opt(g, "--linear-kernel", default="auto", choices=["auto", "panels", "onednn", "mixed"],
        help="CPU fp32 linears: the native panel GEMM, oneDNN, or both (panels up to 64 rows); "
             "auto times them at load and keeps the faster (once per CPU, build, threads and "
             "shapes: the choice is cached)")
    opt(g, "--enforce-eager", action="store_true",
        help="CUDA: run every step eagerly (no CUDA graphs for decode steps)")
    opt(g, "--cuda-graph-max-batch", type=int, default=64,
        help="CUDA: decode-only steps of up to this many sequences replay CUDA graphs captured "
             "at start (batch sizes 1, 2, 4, 8, 16, 24, ...); 0 turns graphs off")
    opt(g, "--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace, role: str = "both") -> Any:
    from kvrelay.engine.config import EngineConfig

    kw: dict[str, Any] = dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        block_size=int(args.block_size), kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_kv_blocks,
        gpu_memory_utilization=float(getattr(args, "gpu_memory_utilization", 0.9)),
        enable_prefix_caching=not args.no_prefix_caching,
        kv_head_groups=int(getattr(args, "kv_head_groups", 1)),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        hybrid_kv=getattr(args, "hybrid_kv", "auto"),
        kv_layout=getattr(args, "kv_layout", "auto"),
        kv_offload_memory=getattr(args, "kv_offload_memory", "0"),
        kv_offload_dir=getattr(args, "kv_offload_dir", None),
        kv_offload_disk=getattr(args, "kv_offload_disk", "4GiB"),
        kv_offload_keep=bool(getattr(args, "kv_offload_keep", False)),
        max_num_batched_tokens=int(args.max_num_batched_tokens),
        max_num_seqs=int(args.max_num_seqs), enable_chunked_prefill=not args.no_chunked_prefill,
        long_prefill_threshold=args.long_prefill_threshold, max_waiting=int(args.max_waiting),
        tpot_slo_ms=None if args.tpot_slo_ms is None else float(args.tpot_slo_ms),
        itl_cap_ms=None if args.itl_cap_ms is None else float(args.itl_cap_ms),
        itl_cap_max_queue_ms=float(args.itl_cap_max_queue_ms),
        num_threads=args.num_threads, attention_backend=args.attention_backend,
        thread_binding=getattr(args, "thread_binding", "auto"),
        linear_kernel=args.linear_kernel,
        tensor_parallel_size=int(args.tensor_parallel_size),
        tp_timeout_s=float(args.tp_timeout_s),
        enforce_eager=bool(getattr(args, "enforce_eager", False)),
        cuda_graph_max_batch=int(getattr(args, "cuda_graph_max_batch", 64)),
        seed=int(args.seed), role=role)
    for k in ("max_model_len", "num_blocks", "long_prefill_threshold", "num_threads"):
        if kw[k] is not None:
            kw[k] = int(kw[k])
    return EngineConfig.from_kwargs(args.model, **kw)


def add_common_process_options(p: argparse.ArgumentParser) -> None:
    opt(p, "--log-level", default="INFO")
    opt(p, "--log-format", default="text", choices=["text", "json"])
    opt(p, "--cluster-token", default=None,
        help="shared secret required on internal ports (prefer --cluster-token-file: a value "
             "on the command line shows in `ps`)")
    opt(p, "--cluster-token-file", default=None,
        help="file holding the cluster token on one line (a mounted Secret); the process "
             "refuses to start when it is missing or empty")
    opt(p, "--otlp-traces-endpoint", default=None,
        help="OpenTelemetry collector (OTLP/gRPC, e.g. 127.0.0.1:4317) that receives this "
             "process's spans; needs pip install 'kvrelay[otel]' (unset: no spans)")
    opt(p, "--ready-file", default=None,
        help="write a JSON file with the bound ports once serving (for supervisors)")


# -- the cluster token ----------------------------------------------------------------------
def read_cluster_token(value: str | None, file: str | None) -> str | None:
    """The cluster token from ``--cluster-token`` and/or ``--cluster-token-file``: a file
    must hold one token (surrounding whitespace ignored); both may be given only if equal.
    A bad file ends the process: starting without the token the operator meant to give would
    leave the internal ports open."""
    if file:
        try:
            token = Path(file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"--cluster-token-file {file}: {e}") from None
        if not token or any(ch.isspace() for ch in token):
            raise SystemExit(f"--cluster-token-file {file}: must hold one token on one line"
                             f" ({'empty' if not token else 'it holds whitespace'})")
        if value and value != token:
            raise SystemExit("--cluster-token and --cluster-token-file (or their KVRELAY_ "
                             "variables) are both set and differ: give one")
        value = token
    return value or None


def cluster_token_from_args(args: argparse.Namespace) -> str | None:
    """``read_cluster_token`` on a parsed command line, warning about a token that shows in
    ``ps`` (given as a flag) or is one of the public placeholders."""
    token = read_cluster_token(args.cluster_token, getattr(args, "cluster_token_file", None))
    if args.cluster_token and os.environ.get(env_name("--cluster-token")) != args.cluster_token:
        logger.warning("the cluster token was given on the command line, where `ps` shows it "
                       "to every user of this host: use --cluster-token-file (or %s)",
                       env_name("--cluster-token"))
    if token and PLACEHOLDER_MARK in token:
        logger.warning("!!! the cluster token is a public placeholder (%s...): anyone who "
                       "reaches the internal ports can join. Put a random one in the Secret "
                       "(openssl rand -hex 32) !!!", token[:4])
    return token


def is_loopback_host(host: str) -> bool:
    """Whether a bind address keeps a port to this host (a name may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed_without_token(what: str, host: str, port: int, token: str | None) -> bool:
    """Logs a warning, and returns True, when ``what`` binds beyond loopback with no cluster
    token: whoever reaches it may call it."""
    if token or is_loopback_host(host):
        return False
    logger.warning("!!! %s %s:%d listens beyond loopback WITHOUT a cluster token: anyone who "
                   "can reach it can call it. Give the router and every worker the same "
                   "--cluster-token-file (or %s), or bind 127.0.0.1 !!!", what, host, port,
                   env_name("--cluster-token"))
    return True
