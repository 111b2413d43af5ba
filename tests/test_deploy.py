"""Kubernetes manifests: every kustomization renders and validates strictly, and its wiring
(replicas, ports, env vars, network policy, autoscaling) matches the CLI and the code.
Helpers in tests/deploy_checks.py."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
import yaml
from deploy_checks import (
    EXTERNAL,
    K8S,
    KUSTOMIZATIONS,
    NAMESPACE,
    OVERLAYS,
    POOL_SERIES,
    POOLS,
    README,
    ROLE_LABEL,
    ROLE_SERVICE,
    ROOT,
    cli_env,
    container_env,
    expand,
    kustomization,
    named,
    of_kind,
    parse,
    pod_labels,
    pool_deployment,
    pool_proc,
    procs,
    quantity,
    render,
    router_proc,
    selects,
    validate,
)


# -- Kustomize renders -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(path: str) -> None:
    docs = render(path)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy",
            "ServiceAccount"} <= kinds
    for d in docs:
        validate(d, path)
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']} outside {NAMESPACE}"


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_references_resolve(path: str) -> None:
    docs = render(path)
    have = {(d["kind"], d["metadata"]["name"]) for d in docs} | EXTERNAL
    for dep in of_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        refs = {("ServiceAccount", pod["serviceAccountName"])}
        for c in pod["containers"] + pod.get("initContainers", []):
            refs |= {("ConfigMap", s["configMapRef"]["name"]) for s in c.get("envFrom", [])}
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    refs.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
                if "secretKeyRef" in ref:
                    refs.add(("Secret", ref["secretKeyRef"]["name"]))
        refs |= {("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
                 for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert refs <= have, f"{dep['metadata']['name']} refers to missing {refs - have}"
    if path == "overlays/cpu-demo":  # self-contained: it generates its own demo Secret
        assert any(d["metadata"]["name"].startswith("kvrelay-secrets")
                   for d in of_kind(docs, "Secret"))


@pytest.mark.parametrize("path", OVERLAYS)
def test_pool_replica_counts_differ_and_reach_the_right_deployments(path: str) -> None:
    docs = render(path)
    counts = {r["name"]: r["count"] for r in kustomization(path)["replicas"]}
    for pool in POOLS:
        dep = pool_deployment(docs, pool)
        proc = pool_proc(docs, pool)
        assert proc.command == "worker" and proc.ns.role == pool, proc.argv
        assert dep["spec"]["replicas"] == counts[dep["metadata"]["name"]], pool
    assert pool_deployment(docs, "prefill")["spec"]["replicas"] != \
        pool_deployment(docs, "decode")["spec"]["replicas"]
    [row] = [ln for ln in README.read_text().splitlines()  # the docs' replica table
             if ln.startswith(f"| {path.split('/')[-1]} | `k8s/{path}/kustomization.yaml`")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert [int(c.split()[0]) for c in cells[-2:]] == \
        [pool_deployment(docs, p)["spec"]["replicas"] for p in POOLS], row
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):  # the overlay's count is the floor
        target = named(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert hpa["spec"]["minReplicas"] == target["spec"]["replicas"]
        assert hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_probes_and_services_hit_ports_the_command_line_opens(path: str) -> None:
    docs = render(path)
    all_procs = procs(docs)
    assert sorted(p.command for p in all_procs) == ["router", "worker", "worker"]
    for p in all_procs:
        opened = p.opened_ports()
        declared = {cp["containerPort"] for cp in p.container["ports"]}
        assert declared == set(opened), f"{p.container['name']}: ports {declared} vs {opened}"
        probes = [p.container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert all(probes), f"{p.container['name']} lacks a probe"
        for probe in probes:
            if "grpc" in probe:
                port = probe["grpc"]["port"]
                assert port in opened, f"gRPC probe on {port}, opened: {opened}"
                assert probe["grpc"].get("service", "") in p.health_services(port), probe
            else:
                port = p.port_number(probe["httpGet"]["port"])
                assert probe["httpGet"]["path"] in p.http_paths(port), probe
        if p.command == "router":  # readiness on /health; the HTTP port must be on
            assert p.container["readinessProbe"]["httpGet"]["path"] == "/health"
        else:
            assert p.container["readinessProbe"]["grpc"]["service"] == ROLE_SERVICE[p.ns.role]
    for svc in of_kind(docs, "Service"):
        backends = [p for p in all_procs if selects({"matchLabels": svc["spec"]["selector"]},
                                                    pod_labels(p.deployment))]
        assert backends, f"Service {svc['metadata']['name']} selects no pods"
        for sp in svc["spec"]["ports"]:
            for p in backends:
                assert p.port_number(sp["targetPort"]) in p.opened_ports(), (svc, sp)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_prometheus_scrapes_ports_that_serve_metrics_to_it(path: str) -> None:
    """Each pod's prometheus.io annotations name a port its command line opens and that
    serves /metrics there: the router's scrape port, not its public HTTP port (which serves
    /metrics to no client holding only an API key); the planner reads the same."""
    docs = render(path)
    for p in procs(docs):
        ann = p.deployment["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") != "true":
            continue
        port = int(ann["prometheus.io/port"])
        assert p.opened_ports().get(port) == "metrics", (p.container["name"], port)
        assert ann.get("prometheus.io/path", "/metrics") in p.http_paths(port)
    router = router_proc(docs)
    scrape = {v: k for k, v in router.opened_ports().items()}["metrics"]
    assert router.ns.metrics_host == "0.0.0.0"
    for dep in of_kind(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            urls = [a.split("=", 1)[1] for a in c.get("args", [])
                    if a.startswith("--router-metrics=")]
            for url in urls:  # the planner: the router's scrape port, through a Service of it
                host, port = url.split("//")[1].split("/")[0].split(":")
                [svc] = [d for d in of_kind(docs, "Service") if d["metadata"]["name"] == host]
                [sp] = [x for x in svc["spec"]["ports"] if x["port"] == int(port)]
                assert router.port_number(sp["targetPort"]) == scrape, (url, sp)


def test_health_service_names_match_the_code() -> None:
    server = (ROOT / "router" / "server.py").read_text()
    worker = (ROOT / "worker" / "process.py").read_text()
    assert '"kvrelay.v1.Generation"' in server and '"kvrelay.v1.Registry"' in server
    for name in (*ROLE_SERVICE.values(), "kvrelay.v1.WorkerControl"):
        assert f'"{name}"' in worker


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_env_vars_are_options_of_the_subcommand(path: str) -> None:
    docs = render(path)
    env_sets = cli_env()
    for p in procs(docs):
        ours = {k for k in p.env if k.startswith("KVRELAY_")}
        unknown = ours - env_sets[p.command]
        assert not unknown, f"{p.container['name']}: `kvrelay {p.command}` ignores {unknown}"
        assert p.env.get("NIXL_LOG_LEVEL", "WARN") == "WARN"
    for dep in of_kind(docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"].get("initContainers", []):
            env = container_env(docs, c)
            argv = expand(c["args"], env)
            parse(argv, env)
            unknown = {k for k in env if k.startswith("KVRELAY_")} - env_sets[argv[0]]
            assert not unknown, f"init container {c['name']}: `kvrelay {argv[0]}` ignores {unknown}"
    from kvrelay.engine.config import parse_bytes

    for p in procs(docs):  # values the parser keeps as strings, checked as the engine will
        if p.command == "worker":
            assert parse_bytes(p.ns.kv_cache_memory) > 0


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_workers_drain_within_the_grace_period(path: str) -> None:
    docs = render(path)
    for pool in POOLS:
        p = pool_proc(docs, pool)
        assert p.pod["terminationGracePeriodSeconds"] > float(p.ns.drain_timeout) + 5, pool
        router, port = p.ns.router[0].rsplit(":", 1)
        control = named(docs, "Service", router)  # heartbeats reach even a not-ready router
        assert control["spec"].get("publishNotReadyAddresses") is True
        assert int(port) in {sp["port"] for sp in control["spec"]["ports"]}
        assert int(port) == int(router_proc(docs).ns.control_port)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_pods_are_locked_down(path: str) -> None:
    docs = render(path)
    sa = named(docs, "ServiceAccount", "kvrelay")
    assert sa.get("automountServiceAccountToken") is False
    for dep in of_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "kvrelay"
        assert pod["automountServiceAccountToken"] is False
        assert pod["enableServiceLinks"] is False  # KVRELAY_<SVC>_PORT would reach the CLI
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True
            for k in ("cpu", "memory"):
                assert quantity(c["resources"]["requests"][k]) <= \
                    quantity(c["resources"]["limits"][k]), (c["name"], k)
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert "/models" in mounts and "/tmp" in mounts
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in pod["containers"]]
        is_worker = pod_labels(dep)[ROLE_LABEL] in POOLS
        assert gpus == ([1] if path == "overlays/gpu" and is_worker else [None])


def test_gpu_overlay_requests_gpus_rdma_and_shm_and_adds_no_capability() -> None:
    docs = render("overlays/gpu")
    for pool in POOLS:
        pod = pool_deployment(docs, pool)["spec"]["template"]["spec"]
        [c] = [c for c in pod["containers"] if c["name"] == "worker"]
        for side in ("requests", "limits"):
            assert c["resources"][side]["nvidia.com/gpu"] == 1
            assert c["resources"][side]["rdma/rdma_shared_device_a"] == 1
        # IPC_LOCK would be inert for the non-root worker and refused by Pod Security (the
        # worker raises RLIMIT_MEMLOCK itself; gpu-workers.yaml says why)
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        [shm] = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_cluster_token_reaches_every_process_as_a_file(path: str, tmp_path) -> None:
    """From the Secret, mounted (not optional: no Secret, no pod), named by
    --cluster-token-file; never in an env var or on the command line, where `ps` and every
    child process would see it. Router and workers then read the same token."""
    import base64

    from kvrelay.cli import router_settings_from_args, worker_settings_from_args

    docs = render(path)
    generated = [d for d in of_kind(docs, "Secret")
                 if d["metadata"]["name"].startswith("kvrelay-secrets")]
    tokens = set()
    for p in procs(docs):
        assert p.ns.cluster_token is None, p.container["name"]
        assert not any(a.startswith("--cluster-token=") for a in p.argv)
        assert "KVRELAY_CLUSTER_TOKEN" not in p.env
        mount_dir, name = p.ns.cluster_token_file.rsplit("/", 1)
        [mount] = [m for m in p.container["volumeMounts"] if m["mountPath"] == mount_dir]
        assert mount.get("readOnly") is True
        [vol] = [v for v in p.pod["volumes"] if v["name"] == mount["name"]]
        secret = vol["secret"]
        assert secret["secretName"].startswith("kvrelay-secrets") and not secret.get("optional")
        assert secret["items"] == [{"key": "KVRELAY_CLUSTER_TOKEN", "path": name}]
        assert secret["defaultMode"] & 0o7 == 0  # not world-readable
        if path != "overlays/cpu-demo":
            continue
        [gen] = [d for d in generated if d["metadata"]["name"] == secret["secretName"]]
        value = base64.b64decode(gen["data"]["KVRELAY_CLUSTER_TOKEN"]).decode()
        local = tmp_path / name
        local.write_text(value)  # the file the kubelet would mount
        p.ns.cluster_token_file = str(local)
        settings = (router_settings_from_args if p.command == "router"
                    else worker_settings_from_args)(p.ns)
        tokens.add(settings.cluster_token)
    if path == "overlays/cpu-demo":
        assert len(tokens) == 1 and None not in tokens


def test_cpu_demo_generates_the_model_every_pod_loads() -> None:
    docs = render("overlays/cpu-demo")
    assert not of_kind(docs, "PersistentVolumeClaim")
    for p in procs(docs):
        [init] = p.pod["initContainers"]
        argv = expand(init["args"], container_env(docs, init))
        assert argv == ["demo-model", p.ns.model], argv
        [vol] = [v for v in p.pod["volumes"] if v["name"] == "models"]
        assert set(vol) == {"name", "emptyDir"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_one_pdb_and_one_headless_service_per_pool(path: str) -> None:
    docs = render(path)
    for pool in POOLS:
        labels = pod_labels(pool_deployment(docs, pool))
        pdbs = [d for d in of_kind(docs, "PodDisruptionBudget")
                if selects(d["spec"]["selector"], labels)]
        assert len(pdbs) == 1 and pdbs[0]["spec"]["maxUnavailable"] == 1, pool
        headless = [d for d in of_kind(docs, "Service") if d["spec"].get("clusterIP") == "None"
                    and selects({"matchLabels": d["spec"]["selector"]}, labels)]
        assert len(headless) == 1, pool


def test_prefill_and_decode_deployments_mirror_each_other() -> None:
    docs = render("base")

    def text(pool: str) -> str:  # without the ConfigMaps' content hashes
        dep = json.dumps(pool_deployment(docs, pool), sort_keys=True, indent=1)
        return re.sub(r'"(kvrelay-[a-z]+)-[a-z0-9]{10}"', r'"\1"', dep)

    decode = text("decode").replace("decode", "prefill").replace("DecodeWorker", "PrefillWorker")
    assert decode == text("prefill")


# -- network policy --------------------------------------------------------------------------------
def ingress_allowed(docs: list[dict[str, Any]], src: dict[str, str], src_ns: str,
                    dst: dict[str, str], port: int) -> bool:
    """Whether the rendered NetworkPolicies let a pod (labels, namespace) reach dst:port."""
    policies = [p for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"], dst)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True

    def port_ok(ports: list[dict[str, Any]] | None) -> bool:
        return not ports or any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)

    def peer_ok(peers: list[dict[str, Any]] | None) -> bool:
        if not peers:
            return True
        for peer in peers:
            if "namespaceSelector" in peer:
                ns_ok = selects(peer["namespaceSelector"],
                                {"kubernetes.io/metadata.name": src_ns})
            else:
                ns_ok = src_ns == NAMESPACE
            if ns_ok and selects(peer.get("podSelector", {}), src):
                return True
        return False

    return any(port_ok(r.get("ports")) and peer_ok(r.get("from"))
               for p in policies for r in p["spec"].get("ingress", []))


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_network_policy_matrix(path: str) -> None:
    docs = render(path)
    router = router_proc(docs)
    pods = {name: (pod_labels(pool_deployment(docs, name) if name in POOLS
                              else router.deployment), NAMESPACE)
            for name in ("router", *POOLS)}
    pods["stranger"] = ({"app": "other"}, NAMESPACE)
    pods["client"] = ({"app": "client"}, "default")
    pods["prometheus"] = ({"app.kubernetes.io/name": "prometheus"}, "monitoring")
    pods["planner"] = ({"app.kubernetes.io/name": "kvrelay",
                        "app.kubernetes.io/component": "planner"}, NAMESPACE)
    worker = pool_proc(docs, "prefill")
    control, metrics = int(worker.ns.port), int(worker.ns.metrics_port)
    ranges = {pool_proc(docs, p).env["UCX_TCP_PORT_RANGE"] for p in POOLS}
    assert len(ranges) == 1, ranges
    lo, hi = (int(x) for x in ranges.pop().split("-"))
    r = router.opened_ports()
    by_kind = {v: k for k, v in r.items()}
    expect = [  # (source, destination, port, allowed)
        ("client", "router", by_kind["grpc"], True), ("client", "router", by_kind["http"], True),
        ("prometheus", "router", by_kind["http"], True),
        ("prometheus", "router", by_kind["metrics"], True),  # the scrape port
        ("planner", "router", by_kind["metrics"], True),
        ("client", "router", by_kind["metrics"], False),
        ("stranger", "router", by_kind["metrics"], False),
        ("decode", "router", by_kind["metrics"], False),
        ("client", "router", by_kind["control"], False),
        ("stranger", "router", by_kind["control"], False),
        ("prefill", "router", by_kind["control"], True),
        ("decode", "router", by_kind["control"], True),
        ("router", "prefill", control, True), ("router", "decode", control, True),
        ("prefill", "decode", control, True),  # GetTransferInfo (NIXL metadata)
        ("decode", "prefill", control, True),  # Fence (blocks given up before their KV came)
        ("client", "prefill", control, False), ("stranger", "prefill", control, False),
        ("stranger", "decode", control, False),
        ("prefill", "decode", lo, True), ("decode", "prefill", hi, True),
        ("decode", "decode", lo, True), ("prefill", "decode", hi + 1, False),
        ("router", "decode", lo, False), ("client", "prefill", lo, False),
        ("prometheus", "prefill", metrics, True), ("prometheus", "decode", metrics, True),
        ("client", "decode", metrics, False), ("router", "prefill", metrics, False),
    ]
    for src, dst, port, want in expect:
        got = ingress_allowed(docs, *pods[src], pods[dst][0], port)
        assert got == want, f"{src} -> {dst}:{port} allowed={got}, expected {want}"


# -- autoscaling -----------------------------------------------------------------------------------
def adapter_metric_names() -> dict[str, str]:
    """Exported series -> the name prometheus-adapter serves it under, per the documented rules."""
    doc = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    out = {}
    for rule in doc["rules"]["custom"]:
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group(0)
        m = re.match(rule["name"]["matches"], series)
        assert m, rule
        out[series] = m.expand(re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule["name"]["as"]))
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert "rate(" not in rule["metricsQuery"]  # gauges
    return out


def exported_series() -> set[str]:
    from prometheus_client import generate_latest

    from kvrelay.engine.cpu.prefetch_tuner import PrefetchChoices
    from kvrelay.engine.engine_core import EngineStats
    from kvrelay.engine.step_cost import StepCostFit
    from kvrelay.worker.metrics import WorkerMetrics

    stats = EngineStats(**{f.name: {} if str(f.type).startswith("dict") else 1
                             for f in dataclasses.fields(EngineStats)})
    stats = dataclasses.replace(stats, step_cost=StepCostFit(1e-3, 1e-5, 1e-9, 1e-4, 1e-7, 32),
                                kv_transfer={"held": 1, "hold_ended_notice": 1},
                                gemm_prefetch=PrefetchChoices({8: True}, 1))
    text = generate_latest(WorkerMetrics(lambda: stats, "prefill", "w").registry).decode()
    return {ln.split("{")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}


def test_hpas_scale_each_pool_on_its_own_exported_metric() -> None:
    docs = render("overlays/gpu")
    names = adapter_metric_names()
    series = exported_series()
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    assert len(hpas) == 2
    for pool in POOLS:
        dep = pool_deployment(docs, pool)
        [hpa] = [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]]
        assert hpa["apiVersion"] == "autoscaling/v2"
        [metric] = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        assert POOL_SERIES[pool] in series, f"workers do not export {POOL_SERIES[pool]}"
        assert metric["pods"]["metric"]["name"] == names[POOL_SERIES[pool]]
        assert ":" not in metric["pods"]["metric"]["name"]
        target = quantity(metric["pods"]["target"]["averageValue"])
        assert target > 0 and (pool == "prefill" or target < 1)  # KV usage is a fraction
        pdb = named(docs, "PodDisruptionBudget", dep["metadata"]["name"])
        assert selects(pdb["spec"]["selector"], pod_labels(dep))


