"""Command-line pieces of the planner: the ``--planner`` options of ``kvrelay serve`` and the
``kvrelay planner`` process (Kubernetes: no Ray)."""

from __future__ import annotations

import argparse
from typing import Any


def _opt_float(v: Any) -> float | None:
    return None if v in (None, "") else float(v)


def add_planner_options(p: argparse.ArgumentParser, *, slo_options: bool = False) -> None:
    """The planner's options; ``slo_options`` adds the SLO and minimum flags too (``kvrelay
    serve`` has them already, shared with ``--autoscale``)."""
    from kvrelay.common.options import opt
    from kvrelay.deploy.planner.predictor import PREDICTORS

    g = p.add_argument_group("SLO planner (with --planner; uses --ttft-slo-ms, --itl-slo-ms, "
                             "--min-prefill, --min-decode)")
    opt(g, "--planner", action="store_true",
        help="size both pools for the SLOs from a profile and the observed, predicted load")
    opt(g, "--profile", default=None, help="profile file written by `kvrelay profile`")
    opt(g, "--max-replicas", type=int, default=4, help="prefill + decode replicas at most")
    opt(g, "--planner-interval", type=float, default=2.0, help="seconds between decisions")
    opt(g, "--planner-predictor", default="seasonal", choices=list(PREDICTORS))
    opt(g, "--planner-down-delay", type=float, default=20.0,
        help="seconds a lower need must last before a pool shrinks")
    opt(g, "--planner-periodic-down-delay", type=float, default=4.0,
        help="the same while the load repeats a known period (its forecast sees the return)")
    opt(g, "--planner-up-step", type=int, default=2, help="replicas a pool grows by at most a step")
    opt(g, "--planner-down-step", type=int, default=1,
        help="replicas a pool shrinks by at most a step (each after --planner-down-delay)")
    opt(g, "--planner-burst-memory", type=float, default=120.0,
        help="seconds the planner keeps capacity for the highest rate seen (0: off)")
    opt(g, "--replica-startup", type=float, default=None,
        help="seconds a new replica takes to serve (default: the profile's)")

    if slo_options:
        opt(g, "--ttft-slo-ms", type=float, default=None)
        opt(g, "--itl-slo-ms", type=float, default=None)
        opt(g, "--min-prefill", type=int, default=1)
        opt(g, "--min-decode", type=int, default=1)


def build_planner(args: argparse.Namespace) -> Any:
    from kvrelay.deploy.planner.planner import PlannerConfig
    from kvrelay.deploy.planner.profile import Profile
    from kvrelay.deploy.planner.ray_loop import PlannerSpec

    if getattr(args, "autoscale", False):
        raise SystemExit("--planner and --autoscale are two policies of one pool: pick one")
    if not args.profile or _opt_float(args.ttft_slo_ms) is None or \
            _opt_float(args.itl_slo_ms) is None:
        raise SystemExit("--planner needs --profile, --ttft-slo-ms and --itl-slo-ms")
    try:
        profile = Profile.load(args.profile)
        config = PlannerConfig(
            ttft_slo_ms=float(args.ttft_slo_ms), itl_slo_ms=float(args.itl_slo_ms),
            max_replicas=int(args.max_replicas), min_prefill=int(args.min_prefill),
            min_decode=int(args.min_decode), interval_s=float(args.planner_interval),
            predictor=args.planner_predictor, down_delay_s=float(args.planner_down_delay),
            periodic_down_delay_s=float(args.planner_periodic_down_delay),
            up_step=int(args.planner_up_step), down_step=int(args.planner_down_step),
            startup_s=_opt_float(args.replica_startup),
            burst_memory_s=float(args.planner_burst_memory))
    except (OSError, ValueError) as e:
        raise SystemExit(f"--planner: {e}") from None
    return PlannerSpec(profile, config)
