"""``kvrelay serve``, ``kvrelay scale`` and ``kvrelay status``: the cluster on Ray.

With no ``--address``, ``serve`` starts an embedded local Ray bound to loopback only, with a
small object store (this is ``make serve``). With an address (``auto`` or ``HOST:PORT``) it
joins an existing Ray cluster (``ray up deploy/ray/cluster.yaml`` or KubeRay).

Ray turns token authentication on for the local clusters it starts (the token lives in
``~/.ray/auth_token``); ``scale``/``status`` given a loopback ``--address`` use that token, as
Ray itself does for ``--address auto``. Connecting, and the settings Ray must see before it is
imported, live in :mod:`kvrelay.deploy.ray_connect`; this module is the commands and their
options.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import threading
from typing import Any

from kvrelay.deploy.ray_connect import EMBEDDED_MIN_CPUS, init_ray, prepare_ray_env

logger = logging.getLogger(__name__)


def _pool_resources(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    try:
        doc = json.loads(text)
        return {str(k): float(v) for k, v in doc.items()}
    except (ValueError, AttributeError) as e:
        raise SystemExit(f"pool resources must be a JSON object of numbers: {e}") from None


def add_serve_options(p: argparse.ArgumentParser) -> None:
    from kvrelay.common.options import add_engine_options, opt
    from kvrelay.common.rpc import HEARTBEAT_INTERVAL_S
    from kvrelay.router.policy import DEFAULT_POLICY, POLICIES
    from kvrelay.worker.settings import WorkerSettings

    add_engine_options(p, model_required=False)
    opt(p, "--prefill", type=int, default=1, help="prefill replicas")
    opt(p, "--decode", type=int, default=1, help="decode replicas")
    opt(p, "--both", type=int, default=0, help="aggregated (role=both) replicas")
    opt(p, "--address", default=None,
        help="Ray cluster to join (auto | HOST:PORT); unset: embedded local Ray on loopback")
    _name_option(p)
    opt(p, "--ray-num-cpus", type=int, default=None,
        help=f"logical CPUs of the embedded Ray (default max(cores, {EMBEDDED_MIN_CPUS}): "
        "each replica asks for --cpus-per-replica of them)")
    opt(p, "--object-store-memory", default="96MiB", help="object store of the embedded Ray")
    opt(p, "--host", default=None, help="router interface (default 127.0.0.1 embedded, "
        "0.0.0.0 on a cluster)")
    opt(p, "--grpc-port", type=int, default=50051)
    opt(p, "--http-port", type=int, default=8000, help="OpenAI HTTP port (-1 = off)")
    opt(p, "--control-port", type=int, default=50052)
    opt(p, "--cpus-per-replica", type=float, default=1.0)
    opt(p, "--gpus-per-replica", type=float, default=None,
        help="default: 1 with --device cuda*, and with --device auto on a cluster with GPUs")
    for pool in ("prefill", "decode", "both"):
        opt(p, f"--{pool}-tp", type=int, default=1,
            help=f"tensor-parallel ranks per {pool} replica (one Ray bundle each, STRICT_PACK; "
                 f"--cpus/--gpus-per-replica are per rank)")
    opt(p, "--prefill-resources", default=None, help='extra Ray resources, JSON {"name": n}')
    opt(p, "--decode-resources", default=None, help='extra Ray resources, JSON {"name": n}')
    opt(p, "--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    opt(p, "--served-model-name", default=None,
        help="model name of the OpenAI API (default: the model directory's name)")
    opt(p, "--api-keys", default=None)
    opt(p, "--chat-template", default=None,
        help="Jinja chat template (a file or the template itself) for checkpoints without one")
    opt(p, "--otlp-traces-endpoint", default=None,
        help="OpenTelemetry collector (OTLP/gRPC HOST:PORT) for the spans of every process "
             "(needs pip install 'kvrelay[otel]')")
    opt(p, "--cluster-token", default=None,
        help="secret of the internal ports (router control, workers); default: a fresh random "
        "one handed to the actors, so nothing outside this launch can join")
    opt(p, "--cluster-token-file", default=None,
        help="file holding the cluster token on one line (e.g. a mounted Secret), instead of "
             "--cluster-token")
    opt(p, "--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL_S,
        help="worker heartbeat period (s); a worker missing 3 is dropped")
    opt(p, "--drain-timeout", type=float,
        default=WorkerSettings(role="both").drain_timeout_s)
    opt(p, "--placement-timeout", type=float, default=None,
        help="how long a new replica may wait for room (s; default 60 embedded, 600 joined)")
    g = p.add_argument_group("autoscaling (with --autoscale)")
    opt(g, "--autoscale", action="store_true", help="scale each pool on its own signals")
    opt(g, "--min-prefill", type=int, default=1)
    opt(g, "--max-prefill", type=int, default=4)
    opt(g, "--min-decode", type=int, default=1)
    opt(g, "--max-decode", type=int, default=4)
    opt(g, "--prefill-queued-tokens-target", type=int, default=4096,
        help="queued prompt tokens per prefill replica above which prefill scales up")
    opt(g, "--decode-kv-usage-target", type=float, default=0.75,
        help="mean KV-cache usage of the decode pool above which it scales up")
    opt(g, "--decode-running-target", type=int, default=48,
        help="running sequences per decode replica above which decode scales up")
    opt(g, "--ttft-slo-ms", type=float, default=None)
    opt(g, "--itl-slo-ms", type=float, default=None)
    opt(g, "--autoscale-interval", type=float, default=1.0, help="seconds between samples")
    opt(g, "--autoscale-sustain", type=int, default=2,
        help="ticks a signal must stay over target before a scale-up")
    opt(g, "--autoscale-idle-ticks", type=int, default=5,
        help="ticks every signal must stay under --autoscale-down-fraction of target "
        "before a scale-down")
    opt(g, "--autoscale-down-fraction", type=float, default=0.3)
    opt(g, "--autoscale-cooldown", type=float, default=10.0,
        help="seconds after a change (once finished) before the next")
    from kvrelay.deploy.planner.cli import add_planner_options

    add_planner_options(p)
    opt(p, "--log-level", default="INFO")


def build_spec(args: argparse.Namespace, loopback: bool,
               cluster_resources: dict[str, float] | None = None) -> Any:
    """The launch; ``cluster_resources`` (``ray.cluster_resources()``) lets ``--device auto``
    ask for the cluster's GPUs (without it, auto plans a CPU launch)."""
    from dataclasses import replace

    from kvrelay.common.options import cluster_token_from_args, engine_config_from_args
    from kvrelay.deploy.autoscaler import AutoscaleConfig, PoolBounds
    from kvrelay.deploy.gpu_request import gpu_request
    from kvrelay.deploy.spec import PoolSpec, ServeSpec
    from kvrelay.engine.tokenizer import read_chat_template
    from kvrelay.router.lifecycle import RouterConfig
    from kvrelay.router.server import RouterSettings
    from kvrelay.worker.settings import WorkerSettings

    model = os.path.abspath(args.model)
    host = args.host or ("127.0.0.1" if loopback else "0.0.0.0")
    http = None if int(args.http_port) < 0 else int(args.http_port)
    keys = tuple(k for k in (args.api_keys or "").split(",") if k)
    token = serve_cluster_token(cluster_token_from_args(args))
    router = RouterSettings(
        model=model, host=host, port=int(args.grpc_port),
        control_host="127.0.0.1" if loopback else "0.0.0.0",
        control_port=int(args.control_port), http_host=host, http_port=http,
        api_keys=keys, cluster_token=token,
        served_model_name=args.served_model_name, config=RouterConfig(policy=args.policy),
        chat_template=read_chat_template(args.chat_template) if args.chat_template else None,
        otlp_traces_endpoint=args.otlp_traces_endpoint or None)
    try:
        req = gpu_request(args.device, _opt_float(args.gpus_per_replica),
                          cluster_resources or {})
    except ValueError as e:
        raise SystemExit(str(e)) from None
    gpus = req.gpus_per_replica
    cpus = float(args.cpus_per_replica)
    pools = {
        "prefill": PoolSpec(int(args.prefill), cpus, float(gpus),
                            _pool_resources(args.prefill_resources), tp=int(args.prefill_tp)),
        "decode": PoolSpec(int(args.decode), cpus, float(gpus),
                           _pool_resources(args.decode_resources), tp=int(args.decode_tp)),
        "both": PoolSpec(int(args.both), cpus, float(gpus), tp=int(args.both_tp)),
    }
    autoscale = None
    if args.autoscale:
        autoscale = AutoscaleConfig(
            prefill=PoolBounds(int(args.min_prefill), int(args.max_prefill)),
            decode=PoolBounds(int(args.min_decode), int(args.max_decode)),
            prefill_queued_tokens_per_replica=int(args.prefill_queued_tokens_target),
            decode_kv_usage=float(args.decode_kv_usage_target),
            decode_running_per_replica=int(args.decode_running_target),
            ttft_slo_ms=_opt_float(args.ttft_slo_ms), itl_slo_ms=_opt_float(args.itl_slo_ms),
            down_fraction=float(args.autoscale_down_fraction),
            sustain=int(args.autoscale_sustain), idle_ticks=int(args.autoscale_idle_ticks),
            cooldown_s=float(args.autoscale_cooldown),
            interval_s=float(args.autoscale_interval))
    placement = _opt_float(args.placement_timeout)
    if placement is None:
        placement = 60.0 if loopback else 600.0
    hb = float(args.heartbeat_interval)
    args.model = model
    return ServeSpec(
        router=replace(router, heartbeat_interval_s=hb),
        worker=WorkerSettings(role="both", cluster_token=token,
                              otlp_traces_endpoint=args.otlp_traces_endpoint or None,
                              heartbeat_interval_s=hb,
                              drain_timeout_s=float(args.drain_timeout)),
        engine=engine_config_from_args(argparse.Namespace(**{**vars(args),
                                                             "device": req.device})),
        pools=pools, loopback=loopback,
        autoscale=autoscale, planner=_planner(args),
        log_level=args.log_level, placement_timeout_s=placement, name=args.name)


def serve_cluster_token(given: str | None) -> str:
    """The token of the internal ports: the one given, or a fresh random one. Every actor this
    launch starts (router, workers, scaled-out replicas) receives it in its settings, so the
    control and worker ports refuse any process this launch did not start, even on a Ray
    cluster whose nodes listen on 0.0.0.0."""
    if given:
        return given
    logger.info("no --cluster-token: generated one for this launch's router and workers")
    return secrets.token_urlsafe(32)


def _planner(args: argparse.Namespace) -> Any:
    from kvrelay.deploy.planner.cli import build_planner

    return build_planner(args) if args.planner else None


def _opt_float(v: Any) -> float | None:
    return None if v in (None, "") else float(v)


def _name_option(p: argparse.ArgumentParser) -> None:
    from kvrelay.deploy.spec import DEFAULT_NAME, check_name

    def name(v: str) -> str:
        try:
            return check_name(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p.add_argument("--name", type=name, default=DEFAULT_NAME,
                   help="the deployment's name on its Ray cluster: several deployments (one "
                   f"per model, say) share a cluster under different names (default "
                   f"{DEFAULT_NAME})")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvrelay.common.logs import setup_logging

    setup_logging("serve", args.log_level)
    if not args.model:
        raise SystemExit("--model is required (make serve passes the demo model)")
    loopback = args.address is None
    prepare_ray_env(args.address)  # build_spec imports ray
    spec = build_spec(args, loopback)  # before Ray starts: a bad flag costs no Ray start
    init_ray(args.address, args.ray_num_cpus, args.object_store_memory)
    import ray

    if args.device == "auto" and args.gpus_per_replica is None:
        spec = build_spec(args, loopback, ray.cluster_resources())

    # After ray.init (it sets its own SIGTERM handler). Ctrl-C in a terminal reaches the whole
    # process group; Ray's daemons block SIGINT, so they outlive us until we have stopped the
    # pools and the router and shut Ray down. A second Ctrl-C skips the clean stop.
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    from kvrelay.deploy.launcher import start
    from kvrelay.deploy.spec import name_flag

    try:
        handle, info = start(spec)
    except BaseException:
        ray.shutdown()
        raise
    host = info["host"] if args.host in (None, "0.0.0.0", "::") else args.host
    addr = "auto" if args.address == "auto" else ray.get_runtime_context().gcs_address
    addr += name_flag(args.name)  # what ``scale`` and ``status`` take after --address
    print(f"kvrelay is serving {os.path.basename(args.model)} on Ray "
          f"({ray.get_runtime_context().gcs_address})\n"
          f"  pools:   {info['counts']}\n"
          f"  gRPC:    {host}:{info['port']}\n"
          + (f"  HTTP:    http://{host}:{info['http_port']}/v1\n" if info["http_port"] else "")
          + f"  try:     kvrelay generate --target {host}:{info['port']} 'Hello there'\n"
          f"  scale:   kvrelay scale --address {addr} --prefill 2 --decode 2\n"
          f"  status:  kvrelay status --address {addr}\n"
          "  Ctrl-C stops everything.", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    print("shutting down ...", flush=True)
    try:
        handle.shutdown()
    except BaseException as e:
        print(f"clean stop failed ({e!r}); stopping Ray", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    print("stopped", flush=True)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    init_ray(args.address)
    from kvrelay.deploy.launcher import connect

    try:
        counts = connect(args.name).scale(prefill=args.prefill, decode=args.decode,
                                          both=args.both)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    print(json.dumps(counts))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    init_ray(args.address)
    from kvrelay.deploy.launcher import connect

    try:
        doc = connect(args.name).status()
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    print(json.dumps(doc, indent=2, default=str))
    return 0


def register() -> list[tuple[str, str, Any]]:
    def serve(p: argparse.ArgumentParser) -> None:
        add_serve_options(p)
        p.set_defaults(func=cmd_serve)

    def scale(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default="auto", help="the Ray cluster (auto | HOST:PORT)")
        _name_option(p)
        p.add_argument("--prefill", type=int, default=None)
        p.add_argument("--decode", type=int, default=None)
        p.add_argument("--both", type=int, default=None)
        p.set_defaults(func=cmd_scale)

    def status(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default="auto")
        _name_option(p)
        p.set_defaults(func=cmd_status)

    return [("serve", "run the cluster on Ray (embedded local Ray by default)", serve),
            ("scale", "change pool replica counts of a running cluster", scale),
            ("status", "pools, workers and autoscaler decisions of a running cluster", status)]

