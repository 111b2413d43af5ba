"""The planner on Kubernetes (deploy/k8s/components/planner, overlays/cpu-demo-planner): the
manifests render and validate strictly, the planner's command line parses, its RBAC reaches
exactly the two pool Deployments, and no HPA fights it."""

from __future__ import annotations

import json

from deploy_checks import K8S, named, of_kind, pool_deployment, render, validate

OVERLAY = "overlays/cpu-demo-planner"


def test_planner_overlay_renders_validates_and_parses() -> None:
    from kvrelay.cli import build_parser
    from kvrelay.deploy.planner.profile import Profile

    docs = render(OVERLAY)
    for d in docs:
        validate(d, OVERLAY)
    dep = named(docs, "Deployment", "kvrelay-planner")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1 and pod["serviceAccountName"] == "kvrelay-planner"
    (c,) = pod["containers"]
    args = build_parser().parse_args(c["args"])
    assert args.func.__name__ == "cmd_planner" and args.apply == "scale"
    assert args.ttft_slo_ms and args.itl_slo_ms
    pools = {p: pool_deployment(docs, p)["metadata"]["name"] for p in ("prefill", "decode")}
    assert (args.prefill_deployment, args.decode_deployment) == (pools["prefill"],
                                                                 pools["decode"])
    role = named(docs, "Role", "kvrelay-planner")
    for rule in role["rules"]:
        assert set(rule["resourceNames"]) == set(pools.values())
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    cm = [d for d in of_kind(docs, "ConfigMap")
          if d["metadata"]["name"].startswith("kvrelay-planner-profile")]
    assert len(cm) == 1 and Profile.load  # the profile ships as a file the planner loads
    json.loads(cm[0]["data"]["profile.json"])
    assert (K8S / "components/planner/profile.json").exists()
