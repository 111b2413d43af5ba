"""``kvrelay serve``, ``kvrelay scale`` and ``kvrelay status``: the cluster on Ray.

With no ``--address``, ``serve`` starts an embedded local Ray bound to loopback only, with a
small object store (this is ``make serve``). With an address (``auto`` or ``HOST:PORT``) it
joins an existing Ray cluster (``ray up deploy/ray/cluster.yaml`` or KubeRay).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from typing import Any

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray binds 127.0.0.1 only
CLUSTER_FILE = "/tmp/ray/ray_current_cluster"


def _pool_resources(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    try:
        doc = json.loads(text)
        return {str(k): float(v) for k, v in doc.items()}
    except (ValueError, AttributeError) as e:
        raise SystemExit(f"pool resources must be a JSON object of numbers: {e}") from None


def add_serve_options(p: argparse.ArgumentParser) -> None:
    from kvrelay.cli import add_engine_options, opt

    add_engine_options(p, model_required=False)
    opt(p, "--prefill", type=int, default=1, help="prefill replicas")
    opt(p, "--decode", type=int, default=1, help="decode replicas")
    opt(p, "--both", type=int, default=0, help="aggregated (role=both) replicas")
    opt(p, "--address", default=None,
        help="Ray cluster to join (auto | HOST:PORT); unset: embedded local Ray on loopback")
    opt(p, "--ray-num-cpus", type=int, default=None, help="logical CPUs of the embedded Ray")
    opt(p, "--host", default=None, help="router interface (default 127.0.0.1 embedded, "
        "0.0.0.0 on a cluster)")
    opt(p, "--grpc-port", type=int, default=50051)
    opt(p, "--http-port", type=int, default=8000, help="OpenAI HTTP port (-1 = off)")
    opt(p, "--control-port", type=int, default=50052)
    opt(p, "--cpus-per-replica", type=float, default=1.0)
    opt(p, "--gpus-per-replica", type=float, default=None, help="default 1 when CUDA is used")
    opt(p, "--prefill-resources", default=None, help='extra Ray resources, JSON {"name": n}')
    opt(p, "--decode-resources", default=None, help='extra Ray resources, JSON {"name": n}')
    opt(p, "--policy", default="least_loaded")
    opt(p, "--api-keys", default=None)
    opt(p, "--cluster-token", default=None)
    opt(p, "--drain-timeout", type=float, default=30.0)
    opt(p, "--autoscale", action="store_true", help="scale each pool on its own signals")
    opt(p, "--min-prefill", type=int, default=1)
    opt(p, "--max-prefill", type=int, default=4)
    opt(p, "--min-decode", type=int, default=1)
    opt(p, "--max-decode", type=int, default=4)
    opt(p, "--ttft-slo-ms", type=float, default=None)
    opt(p, "--itl-slo-ms", type=float, default=None)
    opt(p, "--log-level", default="INFO")


def build_spec(args: argparse.Namespace, loopback: bool) -> Any:
    from kvrelay.cli import engine_config_from_args
    from kvrelay.deploy.autoscaler import AutoscaleConfig, PoolBounds
    from kvrelay.deploy.launcher import PoolSpec, ServeSpec
    from kvrelay.router.lifecycle import RouterConfig
    from kvrelay.router.server import RouterSettings
    from kvrelay.worker import WorkerSettings

    model = os.path.abspath(args.model)
    host = args.host or ("127.0.0.1" if loopback else "0.0.0.0")
    http = None if int(args.http_port) < 0 else int(args.http_port)
    keys = tuple(k for k in (args.api_keys or "").split(",") if k)
    router = RouterSettings(
        model=model, host=host, port=int(args.grpc_port),
        control_host="127.0.0.1" if loopback else "0.0.0.0",
        control_port=int(args.control_port), http_host=host, http_port=http,
        api_keys=keys, cluster_token=args.cluster_token,
        config=RouterConfig(policy=args.policy))
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if args.device.startswith("cuda") else 0.0
    cpus = float(args.cpus_per_replica)
    pools = {
        "prefill": PoolSpec(int(args.prefill), cpus, float(gpus),
                            _pool_resources(args.prefill_resources)),
        "decode": PoolSpec(int(args.decode), cpus, float(gpus),
                           _pool_resources(args.decode_resources)),
        "both": PoolSpec(int(args.both), cpus, float(gpus)),
    }
    autoscale = None
    if args.autoscale:
        autoscale = AutoscaleConfig(
            prefill=PoolBounds(int(args.min_prefill), int(args.max_prefill)),
            decode=PoolBounds(int(args.min_decode), int(args.max_decode)),
            ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms)
    args.model = model
    return ServeSpec(
        router=router,
        worker=WorkerSettings(role="both", cluster_token=args.cluster_token,
                              drain_timeout_s=float(args.drain_timeout)),
        engine=engine_config_from_args(args), pools=pools, loopback=loopback,
        autoscale=autoscale, log_level=args.log_level)


def init_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Connect to Ray; returns True when an embedded loopback-only Ray was started."""
    if address is None:
        os.environ[LOOPBACK_ENV] = "0"
    elif _local_cluster_is_loopback(address):
        os.environ.setdefault(LOOPBACK_ENV, "0")
    import ray

    from kvrelay.deploy.launcher import NAMESPACE

    if address is None:
        ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=96 * 2**20,
                 include_dashboard=False, namespace=NAMESPACE, log_to_driver=True,
                 configure_logging=False)
        return True
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
             configure_logging=False)
    return False


def _local_cluster_is_loopback(address: str) -> bool:
    if address.startswith("127.0.0.1"):
        return True
    if address == "auto" and os.path.exists(CLUSTER_FILE):
        with open(CLUSTER_FILE) as f:
            return f.read().strip().startswith("127.0.0.1")
    return False


def cmd_serve(args: argparse.Namespace) -> int:
    from kvrelay.logs import setup_logging

    setup_logging("serve", args.log_level)
    if not args.model:
        raise SystemExit("--model is required (make serve passes the demo model)")
    loopback = args.address is None
    init_ray(args.address, args.ray_num_cpus)  # first: Ray reads its bind settings at import
    import ray

    spec = build_spec(args, loopback)
    from kvrelay.deploy.launcher import start

    handle, info = start(spec)
    host = info["host"] if not loopback else "127.0.0.1"
    addr = ray.get_runtime_context().gcs_address
    print(f"kvrelay is serving {os.path.basename(args.model)} on Ray ({addr})\n"
          f"  pools:   {info['counts']}\n"
          f"  gRPC:    {host}:{info['port']}\n"
          + (f"  HTTP:    http://{host}:{info['http_port']}/v1\n" if info["http_port"] else "")
          + f"  try:     kvrelay generate --target {host}:{info['port']} 'Hello there'\n"
          f"  scale:   kvrelay scale --address {addr} --prefill 2 --decode 2\n"
          "  Ctrl-C stops everything.", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    print("shutting down ...", flush=True)
    try:
        handle.shutdown()
    finally:
        ray.shutdown()
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    init_ray(args.address)
    from kvrelay.deploy.launcher import connect

    counts = connect().scale(prefill=args.prefill, decode=args.decode, both=args.both)
    print(json.dumps(counts))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    init_ray(args.address)
    from kvrelay.deploy.launcher import connect

    print(json.dumps(connect().status(), indent=2, default=str))
    return 0


def register() -> list[tuple[str, str, Any]]:
    def serve(p: argparse.ArgumentParser) -> None:
        add_serve_options(p)
        p.set_defaults(func=cmd_serve)

    def scale(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default="auto", help="the Ray cluster (auto | HOST:PORT)")
        p.add_argument("--prefill", type=int, default=None)
        p.add_argument("--decode", type=int, default=None)
        p.add_argument("--both", type=int, default=None)
        p.set_defaults(func=cmd_scale)

    def status(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default="auto")
        p.set_defaults(func=cmd_status)

    return [("serve", "run the cluster on Ray (embedded local Ray by default)", serve),
            ("scale", "change pool replica counts of a running cluster", scale),
            ("status", "pools, workers and autoscaler decisions of a running cluster", status)]

