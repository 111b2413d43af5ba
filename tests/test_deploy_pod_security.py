"""Pod Security admission, offline: every pod each kustomization starts is admitted under the
level its namespace enforces (deploy/pod_security.py, a checker of the baseline and restricted
controls), and the checker itself refuses what each control forbids. A pod the level refuses
would never start: the Deployment only shows it in its ReplicaSet's events (issue 54: the gpu
overlay's IPC_LOCK in the restricted namespace)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from deploy_checks import K8S, NAMESPACE, RAYCLUSTER, named, render

from kvrelay.deploy.pod_security import (
    check,
    main,
    namespace_levels,
    pod_templates,
    pod_violations,
    strictest_admitting,
    violations,
)

# base and every overlay, so a new overlay is checked without being listed
RENDERED = ("base", *sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir()
                            if (p / "kustomization.yaml").exists()))


@pytest.mark.parametrize("path", RENDERED)
def test_every_pod_is_admitted_under_its_namespaces_level(path: str) -> None:
    docs = render(path)
    assert namespace_levels(docs) == {NAMESPACE: "restricted"}, \
        "every overlay keeps the namespace at restricted (docs/security.md)"
    audited = named(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    assert audited.get("pod-security.kubernetes.io/warn") == "restricted"
    found = check(docs)
    assert found and {level for level, _ in found.values()} == {"restricted"}
    refused = {where: [str(v) for v in vs] for where, (_, vs) in found.items() if vs}
    assert not refused, f"{path}: Pod Security admission would refuse {refused}"


def test_the_kuberay_cluster_meets_restricted() -> None:
    docs = [d for d in yaml.safe_load_all(RAYCLUSTER.read_text()) if d]
    templates = list(pod_templates(docs))
    assert len(templates) == 3  # the head and the two pools' worker groups
    for t in templates:
        assert violations(t.spec, "restricted", t.metadata) == [], t.where


# -- the checker ----------------------------------------------------------------------------------
def _pod() -> dict[str, Any]:
    """A pod that meets restricted: the base's prefill pod."""
    [t] = [t for t in pod_templates(render("base")) if t.where == "Deployment/kvrelay-prefill"]
    assert pod_violations(t.spec, t.metadata) == []
    return copy.deepcopy(t.spec)


def _worker(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["containers"][0]


MUTATIONS = {  # name -> (change to a compliant pod, the control it breaks, the level refusing it)
    "ipc_lock": (lambda p: _worker(p)["securityContext"]["capabilities"].update(
        add=["IPC_LOCK"]), "Capabilities", "baseline"),
    "sys_admin": (lambda p: _worker(p)["securityContext"]["capabilities"].update(
        add=["SYS_ADMIN"]), "Capabilities", "baseline"),
    "chown": (lambda p: _worker(p)["securityContext"]["capabilities"].update(add=["CHOWN"]),
              "Capabilities", "restricted"),
    "no_drop_all": (lambda p: _worker(p)["securityContext"]["capabilities"].update(drop=[]),
                    "Capabilities", "restricted"),
    "privileged": (lambda p: _worker(p)["securityContext"].update(privileged=True),
                   "Privileged Containers", "baseline"),
    "host_network": (lambda p: p.update(hostNetwork=True), "Host Namespaces", "baseline"),
    "host_pid": (lambda p: p.update(hostPID=True), "Host Namespaces", "baseline"),
    "host_ipc": (lambda p: p.update(hostIPC=True), "Host Namespaces", "baseline"),
    "host_path": (lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/dev"}}),
                  "HostPath Volumes", "baseline"),
    "host_port": (lambda p: _worker(p)["ports"][0].update(hostPort=50060), "Host Ports",
                  "baseline"),
    "nfs_volume": (lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "s",
                                                                       "path": "/"}}),
                   "Volume Types", "restricted"),
    "escalation": (lambda p: _worker(p)["securityContext"].update(allowPrivilegeEscalation=True),
                   "Privilege Escalation", "restricted"),
    "escalation_unset": (lambda p: _worker(p)["securityContext"].pop("allowPrivilegeEscalation"),
                         "Privilege Escalation", "restricted"),
    "root_allowed": (lambda p: p["securityContext"].pop("runAsNonRoot"), "Running as Non-root",
                     "restricted"),
    "container_root": (lambda p: _worker(p)["securityContext"].update(runAsNonRoot=False),
                       "Running as Non-root", "restricted"),
    "uid_0": (lambda p: p["securityContext"].update(runAsUser=0), "Running as Non-root user",
              "restricted"),
    "no_seccomp": (lambda p: p["securityContext"].pop("seccompProfile"), "Seccomp",
                   "restricted"),
    "unconfined": (lambda p: _worker(p)["securityContext"].update(
        seccompProfile={"type": "Unconfined"}), "Seccomp", "baseline"),
    "proc_mount": (lambda p: _worker(p)["securityContext"].update(procMount="Unmasked"),
                   "/proc Mount Type", "baseline"),
    "sysctl": (lambda p: p["securityContext"].update(
        sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "Sysctls", "baseline"),
    "selinux_user": (lambda p: p["securityContext"].update(seLinuxOptions={"user": "u"}),
                     "SELinux", "baseline"),
    "apparmor": (lambda p: _worker(p)["securityContext"].update(
        appArmorProfile={"type": "Unconfined"}), "AppArmor", "baseline"),
    "host_process": (lambda p: p["securityContext"].update(
        windowsOptions={"hostProcess": True}), "HostProcess", "baseline"),
    "init_container": (lambda p: p.setdefault("initContainers", []).append(
        {"name": "i", "image": "x", "securityContext": {"privileged": True}}),
        "Privileged Containers", "baseline"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_control_refuses_what_it_forbids(name: str) -> None:
    change, control, level = MUTATIONS[name]
    pod = _pod()
    change(pod)
    found = pod_violations(pod)
    assert (control, level) in {(v.control, v.level) for v in found}, found
    assert violations(pod, "privileged") == []
    assert bool(violations(pod, "baseline")) is (level == "baseline")
    assert violations(pod, "restricted")
    assert strictest_admitting(pod) == ("privileged" if level == "baseline" else "baseline")


def test_seccomp_and_non_root_may_be_set_per_container_instead() -> None:
    pod = _pod()
    psc = pod["securityContext"]
    del psc["seccompProfile"], psc["runAsNonRoot"]
    _worker(pod)["securityContext"].update(seccompProfile={"type": "RuntimeDefault"},
                                           runAsNonRoot=True)
    assert strictest_admitting(pod) == "restricted"


def test_apparmor_annotations_are_checked() -> None:
    meta = {"annotations": {"container.apparmor.security.beta.kubernetes.io/worker":
                            "unconfined"}}
    assert [v.control for v in violations(_pod(), "baseline", meta)] == ["AppArmor"]
    meta["annotations"]["container.apparmor.security.beta.kubernetes.io/worker"] = \
        "runtime/default"
    assert violations(_pod(), "restricted", meta) == []


def test_unlabelled_namespaces_are_privileged_and_unknown_levels_refused() -> None:
    assert namespace_levels([{"kind": "Namespace", "metadata": {"name": "x"}}]) == \
        {"x": "privileged"}
    with pytest.raises(ValueError, match="unknown Pod Security level"):
        violations(_pod(), "strict")


def test_command_line_exits_1_on_a_refused_pod(tmp_path, capsys) -> None:
    assert main([str(RAYCLUSTER)]) == 0
    pod = _pod()
    _worker(pod)["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
    docs = [{"kind": "Namespace", "metadata": {"name": "n", "labels": {
        "pod-security.kubernetes.io/enforce": "baseline"}}},
        {"kind": "Pod", "metadata": {"name": "p", "namespace": "n"}, "spec": pod}]
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    assert main([str(path)]) == 1
    assert "Pod/p: baseline: 1 violation(s)" in capsys.readouterr().out
