"""The ``kvrelay`` command: every process and tool of the cluster.

Every long option ``--foo-bar`` of a process also reads the environment variable
``KVRELAY_FOO_BAR`` (the flag wins), so containers are configured by env alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvrelay.common.options import (
    add_common_process_options,
    add_engine_options,
    cluster_token_from_args,
    engine_config_from_args,
    env_name,
    opt,
    warn_if_exposed_without_token,
)

if TYPE_CHECKING:
    from kvrelay.router.server import RouterSettings
    from kvrelay.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)
RDMA_DEVICES = "/dev/infiniband"  # where the RDMA device plugins put the verbs devices


def _write_ready(path: str | None, doc: dict[str, Any]) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _read_secret_list(value: str | None, file: str | None) -> tuple[str, ...]:
    keys: list[str] = [k.strip() for k in (value or "").split(",") if k.strip()]
    if file:
        with open(file) as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    return tuple(keys)


# -- subcommands ------------------------------------------------------------------------------
def cmd_demo_model(args: argparse.Namespace) -> int:
    from kvrelay.engine.demo_model import write_demo_model

    write_demo_model(args.out_dir, size=args.size, seed=args.seed)
    print(f"wrote the {args.size} demo model to {args.out_dir}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from kvrelay.engine.llm import LLM
    from kvrelay.engine.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed)
    for text in llm.stream(args.prompt, sp):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def worker_settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    from kvrelay.worker.settings import WorkerSettings

    return WorkerSettings(
        role=args.role, routers=tuple(r for r in args.router or [] if r), host=args.host,
        port=int(args.port), advertise_host=args.advertise_host, worker_id=args.worker_id,
        cluster_token=cluster_token_from_args(args),
        heartbeat_interval_s=float(args.heartbeat_interval),
        lease_ttl_s=float(args.lease_ttl), drain_timeout_s=float(args.drain_timeout),
        kv_sender_grace_s=None if args.kv_sender_grace in (None, "")
        else float(args.kv_sender_grace),
        kv_self_fence_s=_opt_float(args.kv_self_fence),
        kv_write_timeout_s=_opt_float(args.kv_write_timeout),
        kv_layerwise=args.kv_layerwise,
        engine_watchdog_s=_opt_float(args.engine_watchdog) or None,
        metrics_port=None if args.metrics_port in (None, "") else int(args.metrics_port),
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
        kv_events_endpoint=args.kv_events_endpoint or None,
        kv_events_topic=args.kv_events_topic or "",
        kv_events_replay_endpoint=args.kv_events_replay_endpoint or None,
        kv_events_encoding=args.kv_events_encoding)


def _opt_float(value: object) -> float | None:
    return None if value in (None, "") else float(value)  # type: ignore[arg-type]


def raise_memlock_limit(rdma_devices: str = RDMA_DEVICES) -> int:
    """Raise RLIMIT_MEMLOCK's soft limit to its hard one and return the limit now in force.

    RDMA (NIXL/UCX over verbs) pins the memory it registers, and the kernel charges that to
    RLIMIT_MEMLOCK unless the process holds CAP_IPC_LOCK, which a non-root process in a container
    never does (Kubernetes grants added capabilities to root only). Raising the soft limit up to
    the hard one needs no privilege; beyond it is the node's container runtime's to set. Warns
    when an RDMA device is present and the limit is still finite: registrations past it fail and
    UCX moves the KV over TCP instead."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            logger.debug("could not raise RLIMIT_MEMLOCK to %d: %s", hard, e)
    if soft != resource.RLIM_INFINITY and os.path.isdir(rdma_devices):
        logger.warning("RDMA devices are present (%s) but locked memory is limited to %d KiB: "
                       "RDMA registrations beyond it fail and UCX falls back to TCP. Raise the "
                       "container runtime's memlock limit on the node (e.g. containerd's "
                       "systemd unit: LimitMEMLOCK=infinity)", rdma_devices, soft // 1024)
    return soft


def cmd_worker(args: argparse.Namespace) -> int:
    from kvrelay.common.omp_env import apply_worker_omp_defaults

    apply_worker_omp_defaults()  # before the imports below load torch's OpenMP runtime
    from kvrelay.common.gc_tuning import settle_after_startup
    from kvrelay.common.logs import setup_logging
    from kvrelay.worker.process import Worker, run_worker

    setup_logging(f"{args.role}-worker", args.log_level, args.log_format)
    raise_memlock_limit()
    try:
        settings = worker_settings_from_args(args)
    except ValueError as e:  # flags that contradict each other: say which, no traceback
        raise SystemExit(f"kvrelay worker: {e}") from e
    # the router says the same of its control port (router/server.py)
    warn_if_exposed_without_token("worker control port (Reserve, Prefill, Decode, Fence, Drain)",
                                  settings.host, settings.port, settings.cluster_token)
    config = engine_config_from_args(args, role=args.role)

    def ready(w: Worker) -> None:
        settle_after_startup()
        _write_ready(args.ready_file, {"port": w.port, "metrics_port": w.metrics_port,
                                       "worker_id": w.worker_id, "pid": os.getpid()})

    asyncio.run(run_worker(settings, config, on_ready=ready))
    return 0


def router_settings_from_args(args: argparse.Namespace) -> RouterSettings:
    from kvrelay.common.rpc import TLSFiles
    from kvrelay.engine.tokenizer import read_chat_template
    from kvrelay.router.requests import RouterConfig
    from kvrelay.router.server import RouterSettings

    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        tls = TLSFiles(args.tls_cert, args.tls_key)
    return RouterSettings(
        model=args.model, host=args.host, port=int(args.port), control_host=args.control_host,
        control_port=int(args.control_port), http_host=args.http_host,
        http_port=None if args.http_port in (None, "", "-1") else int(args.http_port),
        served_model_name=args.served_model_name,
        api_keys=_read_secret_list(args.api_keys, args.api_key_file),
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port in (None, "") else int(args.metrics_port),
        metrics_token=_one_secret("--metrics-token", args.metrics_token,
                                  args.metrics_token_file),
        cache_salt_by_api_key=_tristate(args.cache_salt_by_api_key),
        chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
        cluster_token=cluster_token_from_args(args), tls=tls,
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
        heartbeat_interval_s=float(args.heartbeat_interval),
        config=RouterConfig(policy=args.policy, lease_ttl_s=float(args.lease_ttl),
                            kv_timeout_s=float(args.kv_timeout),
                            max_inflight=int(args.max_inflight),
                            max_queued=None if args.max_queued in (None, "") else
                            int(args.max_queued),
                            queue_wait_s=float(args.queue_wait),
                            max_migrations=int(args.max_migrations),
                            kv_wait_s=float(args.kv_wait),
                            worker_wait_s=float(args.worker_wait),
                            prefill_ahead=bool(args.prefill_ahead),
                            stream_sessions=bool(args.stream_sessions),
                            prefix_pull=args.prefix_pull))


def _one_secret(flag: str, value: str | None, file: str | None) -> str | None:
    """A secret given by value and/or file (one line): both only if they agree."""
    got = set(_read_secret_list(value, file))
    if len(got) > 1:
        raise SystemExit(f"{flag} and {flag}-file must name one secret")
    return got.pop() if got else None


def _tristate(value: bool | str | None) -> bool | None:
    """A BooleanOptionalAction left unset (None), set by flag (a bool) or by env (a string)."""
    if value is None or isinstance(value, bool):
        return value
    return value.strip().lower() in ("1", "true", "yes", "on")


def cmd_router(args: argparse.Namespace) -> int:
    from kvrelay.common.torch_free import forbid_torch

    forbid_torch()  # the router carries bytes, ids and text; transformers would load torch
    from kvrelay.common.gc_tuning import settle_after_startup
    from kvrelay.common.logs import setup_logging
    from kvrelay.router.server import Router, run_router

    setup_logging("router", args.log_level, args.log_format)
    settings = router_settings_from_args(args)

    def ready(r: Router) -> None:
        settle_after_startup()
        _write_ready(args.ready_file, {"port": r.port, "control_port": r.control_port,
                                       "http_port": r.http_port,
                                       "metrics_port": r.metrics_port, "pid": os.getpid()})

    asyncio.run(run_router(settings, on_ready=ready))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from kvrelay.deploy.planner.measure import progress_bar, run_profile

    def show(done: int, total: int, label: str) -> None:
        sys.stderr.write("\r" + progress_bar(done, total, label).ljust(100)[:100])
        sys.stderr.flush()
    profile = run_profile(engine_config_from_args(args), time_budget_s=float(args.time_budget),
                          progress=show)
    sys.stderr.write("\n")
    profile.save(args.out)
    err = profile.fit_error()
    print(f"wrote {args.out}: {len(profile.prefill_points)} prefill and "
          f"{len(profile.decode_points)} decode points; fit error prefill "
          f"{err['prefill']:.1%}, decode {err['decode']:.1%}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvrelay.client import generate_cli

    return generate_cli(args)


# -- parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvrelay", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-model", help="write the built-in demo model (no hub needed)")
    p.add_argument("out_dir")
    p.add_argument("--size", default="tiny", choices=["tiny", "base"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser("run", help="generate offline with the engine alone")
    add_engine_options(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("worker", help="run a prefill, decode or aggregated worker")
    from kvrelay.worker.settings import KV_EVENTS_ENCODINGS, KV_LAYERWISE, ROLES, WorkerSettings

    ws = WorkerSettings(role="both")  # the defaults the flags show and pass on
    opt(p, "--role", required=env_name("--role") not in os.environ, choices=list(ROLES))
    opt(p, "--router", action="append", help="router control address HOST:PORT (repeatable)")
    opt(p, "--host", default="127.0.0.1", help="interface for the control gRPC port")
    opt(p, "--port", type=int, default=0, help="control gRPC port (0 = any free)")
    opt(p, "--advertise-host", default=None, help="host the router should dial")
    opt(p, "--worker-id", default=None, help="stable name (default role-host-pid)")
    opt(p, "--heartbeat-interval", type=float, default=ws.heartbeat_interval_s)
    opt(p, "--lease-ttl", type=float, default=ws.lease_ttl_s, help="default KV lease TTL (s)")
    opt(p, "--drain-timeout", type=float, default=ws.drain_timeout_s,
        help="SIGTERM drain bound (s)")
    opt(p, "--kv-sender-grace", type=float, default=ws.kv_sender_grace_s,
        help="seconds after a prefill worker left every router's list before the blocks it "
             "was promised (and may still have been writing) are reused (default 10)")
    opt(p, "--kv-self-fence", type=float, default=ws.kv_self_fence_s,
        help="a prefill worker stops writing KV this many seconds after a router last answered "
             "its heartbeat (default 5, at most half the grace); with --kv-write-timeout it "
             "must stay under --kv-sender-grace")
    opt(p, "--kv-write-timeout", type=float, default=ws.kv_write_timeout_s,
        help="seconds a posted KV write may stay in flight before it fails (default 4, at most "
             "0.4 x the grace)")
    opt(p, "--kv-layerwise", choices=list(KV_LAYERWISE), default=ws.kv_layerwise,
        help="a prefill worker sends each step's KV layer by layer while later layers "
             "compute (on) or whole as the step's forward ends (off); auto: layer by layer "
             "on a GPU, and on a CPU only with a core the compute threads leave free")
    opt(p, "--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port")
    opt(p, "--engine-watchdog", type=float, default=ws.engine_watchdog_s,
        help="seconds an engine step may run before the worker reports itself not ready "
             "(gRPC health NOT_SERVING, kvrelay:engine_stuck) until it ends; 0: off")
    opt(p, "--kv-events-endpoint", default=None,
        help="publish the KV blocks each tier stores and evicts as vLLM's KV events (ZMQ "
             "PUB), for external routers (llm-d, Dynamo): tcp://*:5557 binds, tcp://HOST:PORT "
             "connects to a consumer that binds; unset: off")
    opt(p, "--kv-events-topic", default=ws.kv_events_topic,
        help="topic of every KV event message (llm-d's pod discovery: kv@<pod>@<model>)")
    opt(p, "--kv-events-replay-endpoint", default=None,
        help="a ZMQ ROUTER (e.g. tcp://*:5558) that answers a sequence number with the KV "
             "event batches buffered since, for consumers that missed some")
    opt(p, "--kv-events-encoding", choices=list(KV_EVENTS_ENCODINGS),
        default=ws.kv_events_encoding,
        help="map: events as vLLM emits them since vllm#42892 (fields by name); array: the "
             "positional events of earlier vLLM, for consumers that predate it")
    add_engine_options(p)
    add_common_process_options(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("router", help="run the router (public gRPC/HTTP, worker registry)")
    opt(p, "--model", required=env_name("--model") not in os.environ,
        help="checkpoint directory (tokenizer + config)")
    opt(p, "--served-model-name", default=None)
    opt(p, "--host", default="127.0.0.1", help="public gRPC interface")
    opt(p, "--port", type=int, default=50051, help="public gRPC port")
    opt(p, "--control-host", default="127.0.0.1", help="interface for worker heartbeats")
    opt(p, "--control-port", type=int, default=50052)
    opt(p, "--http-host", default="127.0.0.1")
    opt(p, "--http-port", default=None, help="OpenAI-compatible HTTP port (unset = off)")
    opt(p, "--metrics-host", default="127.0.0.1",
        help="address of the scrape port (/metrics, /version)")
    opt(p, "--metrics-port", type=int, default=None,
        help="the scrape port: /metrics and /version for Prometheus and the planner, off the "
             "public ports (unset = off). With API keys set, the public HTTP port serves "
             "/metrics only to a --metrics-token holder")
    opt(p, "--metrics-token", default=None,
        help="scrape token (Authorization: Bearer) required for /metrics wherever it is "
             "served (prefer --metrics-token-file or the env var: argv shows in `ps`)")
    opt(p, "--metrics-token-file", default=None, help="file holding the scrape token")
    from kvrelay.common.rpc import HEARTBEAT_INTERVAL_S
    from kvrelay.router.policy import POLICIES
    from kvrelay.router.requests import RouterConfig

    rc = RouterConfig()  # the defaults the flags show and pass on

    opt(p, "--routing-policy", dest="policy", default=rc.policy, choices=sorted(POLICIES),
        help="round_robin | least_loaded | prefix_aware (prefill and decode workers by cached "
             "prefix against queued work, in measured seconds) | auto (prefix_aware + the fast "
             "lane: short or mostly cached prompts run wholly on a decode worker when the "
             "measured cost model says that is cheaper)")
    opt(p, "--policy", dest="policy", default=argparse.SUPPRESS, choices=sorted(POLICIES),
        help="alias of --routing-policy")
    opt(p, "--lease-ttl", type=float, default=rc.lease_ttl_s)
    opt(p, "--kv-timeout", type=float, default=rc.kv_timeout_s)
    opt(p, "--max-inflight", type=int, default=rc.max_inflight,
        help="requests in flight at once, shared fairly between API keys")
    opt(p, "--max-queued", type=int, default=rc.max_queued,
        help="requests that may wait for an in-flight slot (default: --max-inflight; each API "
             "key its share); past it the least important is refused 429")
    opt(p, "--queue-wait", type=float, default=rc.queue_wait_s,
        help="seconds a request may wait for an in-flight slot before a 429")
    opt(p, "--max-migrations", type=int, default=rc.max_migrations)
    opt(p, "--kv-wait", type=float, default=rc.kv_wait_s,
        help="seconds a request may wait for decode KV room before RESOURCE_EXHAUSTED")
    opt(p, "--worker-wait", type=float, default=rc.worker_wait_s,
        help="seconds a request may wait for a worker to join (a cluster starting or scaled to "
             "zero) before UNAVAILABLE / HTTP 503")
    opt(p, "--prefill-ahead", action=argparse.BooleanOptionalAction, default=rc.prefill_ahead,
        help="send the Prefill beside the decode worker's Reserve and name its KV destination "
             "when the Reserve answers, hiding the Reserve's round trip (pays when the prefill "
             "worker has its own cores or GPU; default: Reserve first, then Prefill)")
    opt(p, "--prefix-pull", choices=("off", "auto", "always"), default=rc.prefix_pull,
        help="pull a prompt's prefix over NIXL from the worker that holds more of it (the decode "
             "worker of the previous turn, another prefill worker) instead of recomputing it: "
             "auto when the measured cost model predicts the pull faster (the crossover is "
             "logged and exported), always whenever one holds more, off (default)")
    opt(p, "--stream-sessions", action=argparse.BooleanOptionalAction,
        default=rc.stream_sessions,
        help="read each decode worker's token streams over one gRPC stream, a decode step's "
             "tokens for all of its requests in one message (default); --no-stream-sessions: "
             "one RPC per request, one message per token")
    opt(p, "--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL_S)
    opt(p, "--api-keys", default=None, help="comma-separated API keys (prefer the env var)")
    opt(p, "--api-key-file", default=None, help="file with one API key per line")
    opt(p, "--chat-template", default=None,
        help="Jinja chat template (a file, or the template itself) for /v1/chat/completions, "
             "instead of the tokenizer's own; needed for checkpoints without one")
    opt(p, "--cache-salt-by-api-key", action=argparse.BooleanOptionalAction, default=None,
        help="isolate prefix-cache sharing per API key (as if each key's requests carried "
             "their own cache_salt): one tenant cannot tell from cached_tokens or TTFT what "
             "another sent. Default: on when API keys are set; --no-cache-salt-by-api-key "
             "lets keys share cached prefixes")
    opt(p, "--tls-cert", default=None)
    opt(p, "--tls-key", default=None)
    add_common_process_options(p)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("profile", help="measure one prefill and one decode replica for the "
                       "planner (engine in this process; writes a JSON profile)")
    add_engine_options(p)
    p.add_argument("--out", default="profile.json", help="profile file to write")
    p.add_argument("--time-budget", type=float, default=170.0,
                   help="seconds of sweep after warm-up; later points are skipped")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("generate", help="stream an answer from a running router")
    opt(p, "--target", default="127.0.0.1:50051", help="router gRPC address")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    opt(p, "--api-key", default=None)
    opt(p, "--tls-ca", default=None, help="CA certificate to verify a TLS router")
    p.add_argument("--show-stats", action="store_true", help="print usage and timing after")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("planner", help="the SLO planner as its own process (Kubernetes: "
                       "scrapes the router, scales the prefill/decode Deployments)")
    from kvrelay.deploy.planner.k8s import add_options, cmd_planner

    add_options(p)
    p.set_defaults(func=cmd_planner)

    from kvrelay.deploy.ray_cli import register  # serve/scale/status live with the launcher

    for name, help_, fn in register():
        fn(sub.add_parser(name, help=help_))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The command ``args`` (``build_parser``'s) names; its exit status."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
