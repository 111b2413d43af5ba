"""An offline checker of the Kubernetes Pod Security Standards, the rules the Pod Security
admission controller enforces per namespace (label ``pod-security.kubernetes.io/enforce``).

Written from the published standard (kubernetes.io/docs/concepts/security/pod-security-standards,
the "latest" version as of Kubernetes 1.30-1.33), so that rendered manifests can be checked
without a cluster: a pod the namespace's level refuses never starts, and the Deployment only
reports it in its ReplicaSet's events. Every control of ``baseline`` and ``restricted`` is here;
``privileged`` has none.

    kubectl kustomize deploy/k8s/overlays/gpu | python -m kvrelay.deploy.pod_security

checks every pod template against its namespace's enforced level (a namespace the input does not
define counts as ``restricted``) and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

LEVELS = ("privileged", "baseline", "restricted")  # each admits a subset of the one before
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"

# baseline: capabilities a container may add (the container runtime's default set minus NET_RAW)
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# baseline: sysctls namespaced to the pod and isolated from the node
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})
# restricted: the only volume sources (everything else, hostPath above all, is refused)
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                "persistentVolumeClaim", "projected", "secret"})
SECCOMP_CONFINED = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


@dataclass(frozen=True)
class Violation:
    """One control a pod breaks: ``level`` is the lowest level that refuses it."""

    level: str
    control: str
    field: str
    detail: str

    def __str__(self) -> str:
        return f"{self.control} ({self.level}): {self.field}: {self.detail}"


class PodTemplate(NamedTuple):
    where: str  # Kind/name, and the template's place inside it
    namespace: str | None
    metadata: dict[str, Any]
    spec: dict[str, Any]


# -- the controls -----------------------------------------------------------------------------
def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for key in CONTAINER_LISTS:
        for i, c in enumerate(spec.get(key) or []):
            yield f"spec.{key}[{i}]({c.get('name', '?')})", c


def _baseline(meta: dict[str, Any], spec: dict[str, Any]) -> Iterator[Violation]:
    def v(control: str, field: str, detail: str) -> Violation:
        return Violation("baseline", control, field, detail)

    psc = spec.get("securityContext") or {}
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        yield v("HostProcess", "spec.securityContext.windowsOptions.hostProcess", "true")
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(ns):
            yield v("Host Namespaces", f"spec.{ns}", "true")
    for i, vol in enumerate(spec.get("volumes") or []):
        if "hostPath" in vol:
            yield v("HostPath Volumes", f"spec.volumes[{i}]({vol.get('name')})", "hostPath")
    for name in (psc.get("sysctls") or []):
        if name.get("name") not in SAFE_SYSCTLS:
            yield v("Sysctls", "spec.securityContext.sysctls", f"{name.get('name')} is not safe")
    yield from _seccomp_not_unconfined("spec.securityContext", psc, v)
    yield from _selinux("spec.securityContext", psc, v)
    yield from _apparmor_profile("spec.securityContext", psc, v)
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" \
                and not value.startswith("localhost/"):
            yield v("AppArmor", f"metadata.annotations[{key}]", value)
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            yield v("HostProcess", f"{where}.securityContext.windowsOptions.hostProcess", "true")
        if sc.get("privileged"):
            yield v("Privileged Containers", f"{where}.securityContext.privileged", "true")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            yield v("Capabilities", f"{where}.securityContext.capabilities.add",
                    f"{sorted(added)} beyond the baseline set")
        for i, port in enumerate(c.get("ports") or []):
            if port.get("hostPort"):
                yield v("Host Ports", f"{where}.ports[{i}].hostPort", str(port["hostPort"]))
        if sc.get("procMount", "Default") != "Default":
            yield v("/proc Mount Type", f"{where}.securityContext.procMount", sc["procMount"])
        yield from _seccomp_not_unconfined(f"{where}.securityContext", sc, v)
        yield from _selinux(f"{where}.securityContext", sc, v)
        yield from _apparmor_profile(f"{where}.securityContext", sc, v)


def _seccomp_not_unconfined(where: str, sc: dict[str, Any], v: Any) -> Iterator[Violation]:
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield v("Seccomp", f"{where}.seccompProfile.type", "Unconfined")


def _selinux(where: str, sc: dict[str, Any], v: Any) -> Iterator[Violation]:
    opts = sc.get("seLinuxOptions") or {}
    if opts.get("type", "") not in SELINUX_TYPES:
        yield v("SELinux", f"{where}.seLinuxOptions.type", opts["type"])
    for key in ("user", "role"):
        if opts.get(key):
            yield v("SELinux", f"{where}.seLinuxOptions.{key}", "must be unset")


def _apparmor_profile(where: str, sc: dict[str, Any], v: Any) -> Iterator[Violation]:
    kind = (sc.get("appArmorProfile") or {}).get("type")
    if kind not in (None, "RuntimeDefault", "Localhost"):
        yield v("AppArmor", f"{where}.appArmorProfile.type", kind)


def _restricted(spec: dict[str, Any]) -> Iterator[Violation]:
    def v(control: str, field: str, detail: str) -> Violation:
        return Violation("restricted", control, field, detail)

    for i, vol in enumerate(spec.get("volumes") or []):
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield v("Volume Types", f"spec.volumes[{i}]({vol.get('name')})",
                    f"{sorted(kinds - RESTRICTED_VOLUMES)} not allowed")
    psc = spec.get("securityContext") or {}
    containers = list(_containers(spec))
    if psc.get("runAsUser") == 0:
        yield v("Running as Non-root user", "spec.securityContext.runAsUser", "0")
    pod_nonroot = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in SECCOMP_CONFINED
    windows = (spec.get("os") or {}).get("name") == "windows"
    for where, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("runAsNonRoot") is False or not (pod_nonroot or sc.get("runAsNonRoot")):
            yield v("Running as Non-root", f"{where}.securityContext.runAsNonRoot",
                    "must be true (here or in the pod's securityContext)")
        if sc.get("runAsUser") == 0:
            yield v("Running as Non-root user", f"{where}.securityContext.runAsUser", "0")
        if windows:  # the three controls below exempt Windows pods
            continue
        if sc.get("allowPrivilegeEscalation") is not False:
            yield v("Privilege Escalation", f"{where}.securityContext.allowPrivilegeEscalation",
                    "must be false")
        kind = (sc.get("seccompProfile") or {}).get("type")
        if not (kind in SECCOMP_CONFINED or (kind is None and pod_seccomp)):
            yield v("Seccomp", f"{where}.securityContext.seccompProfile.type",
                    "RuntimeDefault or Localhost, here or in the pod's securityContext")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            yield v("Capabilities", f"{where}.securityContext.capabilities.drop",
                    "must include ALL")
        added = set(caps.get("add") or []) - RESTRICTED_CAPABILITIES
        if added:
            yield v("Capabilities", f"{where}.securityContext.capabilities.add",
                    f"{sorted(added)}: only NET_BIND_SERVICE may be added")


def pod_violations(spec: dict[str, Any], metadata: dict[str, Any] | None = None
                   ) -> list[Violation]:
    """Every control of ``baseline`` and ``restricted`` the pod breaks."""
    return [*_baseline(metadata or {}, spec), *_restricted(spec)]


def violations(spec: dict[str, Any], level: str, metadata: dict[str, Any] | None = None
               ) -> list[Violation]:
    """The controls of ``level`` the pod breaks: none means the level admits it."""
    if level not in LEVELS:
        raise ValueError(f"unknown Pod Security level {level!r} (one of {', '.join(LEVELS)})")
    refusing = set(LEVELS[1:LEVELS.index(level) + 1])
    return [x for x in pod_violations(spec, metadata) if x.level in refusing]


def strictest_admitting(spec: dict[str, Any], metadata: dict[str, Any] | None = None) -> str:
    """The strictest level that admits the pod."""
    broken = {x.level for x in pod_violations(spec, metadata)}
    return next(lv for lv in reversed(LEVELS)
                if not broken & set(LEVELS[1:LEVELS.index(lv) + 1]))


# -- rendered manifests -----------------------------------------------------------------------
def pod_templates(docs: Iterable[dict[str, Any]]) -> Iterator[PodTemplate]:
    """Every pod a rendered object starts: workloads' templates, CronJobs' job templates,
    bare Pods and KubeRay's head and worker groups."""
    for d in docs:
        kind, meta = d.get("kind"), d.get("metadata") or {}
        name, ns, spec = f"{kind}/{meta.get('name')}", meta.get("namespace"), d.get("spec") or {}
        if kind == "Pod":
            yield PodTemplate(name, ns, meta, spec)
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            t = spec["template"]
            yield PodTemplate(name, ns, t.get("metadata") or {}, t["spec"])
        elif kind == "CronJob":
            t = spec["jobTemplate"]["spec"]["template"]
            yield PodTemplate(name, ns, t.get("metadata") or {}, t["spec"])
        elif kind == "RayCluster":
            groups = [("headGroupSpec", spec["headGroupSpec"])]
            groups += [(f"workerGroupSpecs({g.get('groupName')})", g)
                       for g in spec.get("workerGroupSpecs") or []]
            for where, g in groups:
                t = g["template"]
                yield PodTemplate(f"{name} {where}", ns, t.get("metadata") or {}, t["spec"])


def namespace_levels(docs: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Enforced level per Namespace the documents define (no label: ``privileged``, the
    admission controller's default)."""
    return {d["metadata"]["name"]: (d["metadata"].get("labels") or {}).get(ENFORCE_LABEL,
                                                                           "privileged")
            for d in docs if d.get("kind") == "Namespace"}


def check(docs: Iterable[dict[str, Any]], default_level: str = "restricted"
          ) -> dict[str, tuple[str, list[Violation]]]:
    """Per pod template: the level its namespace enforces and the controls of it the pod breaks.
    Namespaces the documents do not define count as ``default_level``."""
    docs = list(docs)
    levels = namespace_levels(docs)
    out = {}
    for t in pod_templates(docs):
        level = levels.get(t.namespace or "", default_level)
        out[t.where] = (level, violations(t.spec, level, t.metadata))
    return out


def main(argv: list[str] | None = None) -> int:
    import yaml

    ap = argparse.ArgumentParser(prog="python -m kvrelay.deploy.pod_security",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="rendered manifests (default: stdin)")
    ap.add_argument("--default-level", choices=LEVELS, default="restricted",
                    help="level of namespaces the input does not define")
    args = ap.parse_args(argv)
    texts = [Path(f).read_text() for f in args.files] if args.files else [sys.stdin.read()]
    docs = [d for text in texts for d in yaml.safe_load_all(text) if d]
    failed = False
    for where, (level, found) in check(docs, args.default_level).items():
        print(f"{where}: {level}: " + ("admitted" if not found else f"{len(found)} violation(s)"))
        for x in found:
            print(f"  {x}")
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
