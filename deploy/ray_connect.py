"""Connecting to Ray, or starting the embedded one ``kvrelay serve`` runs without ``--address``.

Ray reads some settings only when it is first imported: whether it binds loopback only, and
whether it authenticates with a token. ``prepare_ray_env`` sets them from the address before
anything imports ray; ``init_ray`` then connects (or starts an embedded Ray bound to loopback
only, with a small object store).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray binds 127.0.0.1 only
CLUSTER_FILE = "/tmp/ray/ray_current_cluster"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
DEFAULT_TOKEN_FILE = os.path.join("~", ".ray", "auth_token")

NAMESPACE = "kvrelay"  # the Ray namespace of kvrelay's named actors
EMBEDDED_MIN_CPUS = 8  # logical CPUs of an embedded Ray: room for 2P2D + headroom on a laptop


def worker_env(environ: Mapping[str, str], *, loopback: bool) -> dict[str, str]:
    """Variables a worker replica's process needs before it loads OpenMP (torch) and UCX (the
    KV data plane under NIXL) that ``environ`` lacks: the engine's OpenMP defaults, and on a
    loopback-only cluster UCX kept off every other network device."""
    from kvrelay.common.omp_env import apply_worker_omp_defaults

    env = apply_worker_omp_defaults(dict(environ))
    if loopback and "UCX_NET_DEVICES" not in environ:
        env["UCX_NET_DEVICES"] = "lo"
    return env


def init_ray(address: str | None, num_cpus: int | None = None,
             object_store_memory: int | str | None = None) -> bool:
    """Connect to Ray; returns True when an embedded loopback-only Ray was started."""
    prepare_ray_env(address)
    import ray

    if address is None:
        from kvrelay.engine.config import parse_bytes

        store = parse_bytes(object_store_memory or "96MiB")
        # Ray's worker processes inherit the environment this process has now (the raylet's):
        # with the replicas' variables in it, a replica's actor needs no runtime env of its
        # own and takes a Ray worker that is already started (~1 s sooner than a fresh one).
        env = worker_env(os.environ, loopback=True)
        os.environ.update(env)
        try:
            ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, EMBEDDED_MIN_CPUS),
                     object_store_memory=store, include_dashboard=False, namespace=NAMESPACE,
                     log_to_driver=True, configure_logging=False)
        finally:
            for k in env:
                del os.environ[k]
        return True
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
             configure_logging=False)
    return False


def prepare_ray_env(address: str | None) -> None:
    """Settings Ray reads when it is first imported: call before anything imports ray."""
    if "ray" in sys.modules and address is None and os.environ.get(LOOPBACK_ENV) != "0":
        raise RuntimeError("ray was imported before the embedded Ray could be made "
                           f"loopback-only: set {LOOPBACK_ENV}=0 first")
    if address is None:
        os.environ[LOOPBACK_ENV] = "0"
    elif _local_cluster_is_loopback(address):
        os.environ.setdefault(LOOPBACK_ENV, "0")
        _use_local_auth_token()


def _is_loopback(address: str) -> bool:
    return address.startswith(("127.", "localhost"))


def _local_cluster_is_loopback(address: str) -> bool:
    """Whether ``address`` names a loopback-only Ray on this machine (as ``kvrelay serve``
    embeds). Ray itself would rewrite a 127.0.0.1 address to this machine's IP unless told
    otherwise, and such a Ray does not listen there."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "") or "auto"
    if address != "auto":
        return _is_loopback(address)
    if os.path.exists(CLUSTER_FILE):  # written by `ray start`
        with open(CLUSTER_FILE) as f:
            return _is_loopback(f.read().strip())
    found = _local_gcs_addresses()  # what Ray's "auto" falls back to: local raylets
    return bool(found) and all(_is_loopback(a) for a in found)


def _local_gcs_addresses() -> set[str]:
    """``--gcs-address`` of every raylet on this machine (Linux /proc; elsewhere: none)."""
    out: set[str] = set()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if cmd and os.path.basename(cmd[0]) == "raylet":
            out.update(a.split("=", 1)[1] for a in cmd if a.startswith("--gcs-address="))
    return out


def _use_local_auth_token() -> None:
    """Ray enables token auth on the local clusters it starts and, for ``address="auto"``,
    finds the token by itself; for an explicit loopback address it does not. Do the same there
    (an explicit RAY_AUTH_MODE wins)."""
    if os.environ.get(AUTH_MODE_ENV) is not None:
        return
    if "ray" in sys.modules:  # already imported: let Ray check and refresh its own config
        try:
            from ray._private.authentication.authentication_token_setup import (
                maybe_enable_token_auth_if_token_available,
            )
        except ImportError:
            pass
        else:
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
            return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser(DEFAULT_TOKEN_FILE)
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(path):
        os.environ[AUTH_MODE_ENV] = "token"
