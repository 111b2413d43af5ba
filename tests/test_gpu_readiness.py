"""The GPU path's decisions, checked on the CPU (issue 24): device selection, the Ray GPU
request, flash-attn's dtype gate and import fallback, the CUDA memory budget, the KV-ready event's
device, the Docker image's torch/CUDA pairing, the GPU packaging (issue 53: one flash-attn built
once, nixl-cu12 alone in the CUDA 12 image, `make test-gpu` on the GPU install, NIXL's own
environment report) and the Kubernetes GPU overlay. What needs a real GPU lives in tests/gpu/
(``make test-gpu``)."""

from __future__ import annotations

import builtins
import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE_CUDA = ROOT / "deploy" / "docker" / "Dockerfile.cuda"
K8S = ROOT / "deploy" / "k8s"

# The one table: CUDA builds download.pytorch.org publishes per torch release (cuXYZ index
# suffixes). Extend it when constraints.txt moves torch; the image must use one of these, with a
# toolkit of the same major.minor (flash-attn refuses a CUDA major mismatch at build time).
TORCH_CUDA_BUILDS: dict[str, tuple[str, ...]] = {
    "2.13.0": ("cu126", "cu130"),
}


# -- device selection ------------------------------------------------------------------------
def test_auto_device_follows_cuda_visibility() -> None:
    from kvrelay.engine.device import resolve_device

    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=True).type == "cuda"
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")


def test_cuda_asked_but_invisible_fails_loudly() -> None:
    from kvrelay.engine.device import resolve_device

    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(RuntimeError, match="sees 1 CUDA device"):
        resolve_device("cuda:1", cuda_available=True, device_count=1)
    assert resolve_device("cuda:1", cuda_available=True, device_count=2) == torch.device("cuda", 1)
    assert resolve_device("cuda", cuda_available=True, device_count=1) == torch.device("cuda", 0)


def test_tp_ranks_take_consecutive_devices_from_rank_0s() -> None:
    """Rank r of a replica whose rank 0 is on ``cuda:B`` runs on ``cuda:B+r`` (not ``cuda:r``,
    which put rank 1 of a replica started on cuda:2 onto cuda:1); a replica past the last
    device this process sees is refused at start, naming the devices it needs."""
    from kvrelay.engine.device import rank_device

    def ranks(name: str, size: int, count: int) -> list[torch.device]:
        return [rank_device(name, r, size, cuda_available=True, device_count=count)
                for r in range(size)]

    assert ranks("cuda", 2, 2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert ranks("cuda:2", 2, 4) == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert ranks("auto", 4, 4) == [torch.device("cuda", i) for i in range(4)]
    assert ranks("cpu", 2, 4) == [torch.device("cpu")] * 2
    with pytest.raises(RuntimeError, match=r"needs CUDA devices 3..4, but this process sees 4"):
        rank_device("cuda:3", 0, 2, cuda_available=True, device_count=4)
    assert rank_device("cuda:3", 0, 1, cuda_available=True, device_count=4) == \
        torch.device("cuda", 3)


def test_cuda_kv_budget_respects_utilization() -> None:
    from kvrelay.engine.cuda.memory import cuda_kv_budget

    gib = 2**30
    # 80 GiB card, 18 GiB of this process's (weights, a forward's), 60 GiB free: its 0.9
    # share less its own, 54 GiB usable.
    assert cuda_kv_budget(8 * gib, 0.9, 60 * gib, 80 * gib, own=18 * gib) == 8 * gib
    assert cuda_kv_budget(100 * gib, 0.9, 60 * gib, 80 * gib, own=18 * gib) == 54 * gib
    # Never past what leaves 2 % of the device free (another process holds most of it).
    assert cuda_kv_budget(100 * gib, 0.9, 10 * gib, 80 * gib, own=2 * gib) == \
        10 * gib - round(0.02 * 80 * gib)
    with pytest.raises(RuntimeError, match="no GPU memory left"):
        cuda_kv_budget(gib, 0.5, 30 * gib, 80 * gib, own=45 * gib)
    with pytest.raises(ValueError):
        cuda_kv_budget(gib, 1.5, 30 * gib, 80 * gib)
    # Two workers started together on one 80 GiB card, 0.45 each, 8 GiB of weights each: both
    # see 64 GiB free; each takes its share less its own, 28 GiB, not 56 GiB (together 112).
    both = [cuda_kv_budget(100 * gib, 0.45, 64 * gib, 80 * gib, own=8 * gib) for _ in "pd"]
    assert both == [28 * gib, 28 * gib] and sum(both) + 2 * 8 * gib <= 0.9 * 80 * gib


def test_cache_config_validates_utilization() -> None:
    from kvrelay.engine.config import CacheConfig

    assert CacheConfig().gpu_memory_utilization == 0.9
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=0.0)


def test_cpu_kv_budget_is_untouched() -> None:
    from kvrelay.engine.cpu.platform import CpuPlatform

    platform = CpuPlatform.__new__(CpuPlatform)  # its budget reads no device
    assert platform.kv_budget(123456, 0.5, activations=10**9) == 123456


# -- Ray GPU requests ------------------------------------------------------------------------
@pytest.mark.parametrize("device,explicit,cluster,want", [
    ("auto", None, {"CPU": 16.0}, (0.0, "cpu")),
    ("auto", None, {"CPU": 16.0, "GPU": 8.0}, (1.0, "cuda")),
    ("cuda", None, {}, (1.0, "cuda")),
    ("cuda:0", None, {"GPU": 1.0}, (1.0, "cuda:0")),
    ("cpu", None, {"GPU": 8.0}, (0.0, "cpu")),
    ("auto", 2.0, {"GPU": 8.0}, (2.0, "cuda")),
    ("auto", 0.0, {"GPU": 8.0}, (0.0, "cpu")),
    ("cuda", 0.5, {"GPU": 1.0}, (0.5, "cuda")),
])
def test_gpu_request(device: str, explicit: float | None, cluster: dict[str, float],
                     want: tuple[float, str]) -> None:
    from kvrelay.deploy.gpu_request import gpu_request

    assert tuple(gpu_request(device, explicit, cluster)) == want


def test_cuda_with_zero_gpus_is_refused() -> None:
    from kvrelay.deploy.gpu_request import gpu_request

    with pytest.raises(ValueError, match="hide"):
        gpu_request("cuda", 0.0, {"GPU": 1.0})


def _serve_args(model: str, *extra: str) -> Any:
    from kvrelay.cli import build_parser

    return build_parser().parse_args(["serve", "--model", model, "--http-port", "-1", *extra])


def test_build_spec_auto_on_a_gpu_cluster(tmp_path: Path) -> None:
    from kvrelay.deploy.ray_cli import build_spec

    spec = build_spec(_serve_args(str(tmp_path)), True, {"CPU": 32.0, "GPU": 4.0})
    assert {p.gpus for p in spec.pools.values()} == {1.0}
    assert spec.engine.model.device == "cuda"  # a replica that sees no GPU then fails at start
    cpu = build_spec(_serve_args(str(tmp_path)), True, {"CPU": 32.0})
    assert {p.gpus for p in cpu.pools.values()} == {0.0}
    assert cpu.engine.model.device == "cpu"
    two = build_spec(_serve_args(str(tmp_path), "--gpus-per-replica", "2"), True)
    assert {p.gpus for p in two.pools.values()} == {2.0}


# -- attention backend selection -------------------------------------------------------------
def _pretend_flash_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvrelay.engine.attention as attn

    monkeypatch.setattr(attn, "flash_available", lambda: True)


def test_flash_only_for_half_precision(monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    import kvrelay.engine.attention as attn

    _pretend_flash_installed(monkeypatch)
    sentinel = object()
    monkeypatch.setattr(attn, "_import_flash", lambda: sentinel)
    cuda = torch.device("cuda", 0)
    for dt in (torch.float16, torch.bfloat16):
        assert attn.select_backend("auto", cuda, dt) is sentinel
    with caplog.at_level(logging.INFO, logger=attn.__name__):
        name = attn.select_backend("auto", cuda, torch.float32).name
    assert name == "sdpa" and "no torch.float32 kernels" in caplog.text
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        attn.select_backend("flash", cuda, torch.float32)


def test_flash_that_does_not_load_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import kvrelay.engine.attention as attn

    _pretend_flash_installed(monkeypatch)
    real_import = builtins.__import__

    def broken(name: str, *a: Any, **kw: Any) -> Any:
        if name.endswith("attention.flash") or name.startswith("flash_attn"):
            raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", broken)
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger=attn.__name__):
        name = attn.select_backend("auto", cuda, torch.bfloat16).name
    assert name == "sdpa" and "undefined symbol" in caplog.text
    with pytest.raises(ImportError, match="does not load"):
        attn.select_backend("flash", cuda, torch.bfloat16)


def test_flash_absent_on_a_gpu_warns_and_the_worker_exports_its_backend(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No flash-attn on a GPU worker: it still serves through torch SDPA, with a WARNING (issue
    53: it was silent), and its /metrics say which backend it attends with."""
    from prometheus_client import generate_latest

    import kvrelay.engine.attention as attn
    from kvrelay.engine.cpu.prefetch_tuner import PrefetchChoices
    from kvrelay.engine.engine_types import EngineStats
    from kvrelay.engine.step_cost import StepCostFit
    from kvrelay.worker.metrics import WorkerMetrics

    monkeypatch.setattr(attn, "flash_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=attn.__name__):
        name = attn.select_backend("auto", torch.device("cuda", 0), torch.bfloat16).name
    assert name == "sdpa" and "flash-attn is not installed" in caplog.text
    assert "make install-gpu" in caplog.text
    stats = dataclasses.replace(
        EngineStats(**{n: {} if str(f.type).startswith("dict") else 1
                       for n, f in EngineStats.__dataclass_fields__.items()}),
        step_cost=StepCostFit(1e-3, 1e-5, 1e-9, 1e-4, 1e-7, 32),
        gemm_prefetch=PrefetchChoices({8: True}, 3))
    text = generate_latest(WorkerMetrics(lambda: stats, "decode", "d1", attention=name,
                                         device="cuda").registry).decode()
    assert ('kvrelay:attention_backend_info{backend="sdpa",device="cuda",pool="decode",'
            'worker="d1"} 1.0') in text


@pytest.mark.parametrize(("conf", "refused"), [
    (None, False), ("", False), ("max_split_size_mb:128", False),
    ("expandable_segments:False", False), ("expandable_segments:True", True),
    ("max_split_size_mb:64, expandable_segments:true", True)])
def test_expandable_segments_are_refused_for_a_transferred_kv_cache(conf, refused) -> None:
    from kvrelay.engine.cuda.memory import refuse_expandable_segments

    if refused:
        with pytest.raises(ValueError, match=r"expandable_segments.*unset it"):
            refuse_expandable_segments(conf)
    else:
        refuse_expandable_segments(conf)


def test_cpu_selection_unchanged() -> None:
    from kvrelay.engine.attention import select_backend

    assert select_backend("auto", torch.device("cpu"), torch.float32).name in ("native", "sdpa")
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16).name == "sdpa"


# -- the KV-ready event ----------------------------------------------------------------------
class _FakeEvent:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.stream: Any = None

    def record(self, stream: Any) -> None:
        self.stream = stream


def test_ready_event_is_recorded_on_the_workers_device() -> None:
    from kvrelay.kv_transfer.cuda_sync import record_ready_event

    asked: list[torch.device] = []

    def stream_of(device: torch.device) -> str:
        asked.append(device)
        return f"stream-of-{device}"

    ev = record_ready_event(torch.device("cuda", 1), _FakeEvent, stream_of)
    assert asked == [torch.device("cuda", 1)]
    assert ev.stream == "stream-of-cuda:1"
    assert ev.kw == {"blocking": True}  # the sender sleeps in synchronize(), it does not spin


# -- the CUDA image --------------------------------------------------------------------------
def _dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE_CUDA.read_text(), re.M))


def test_dockerfile_torch_cuda_pairing() -> None:
    args = _dockerfile_args()
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None
    assert args["TORCH_VERSION"] == pinned.group(1), "the image and constraints.txt disagree"
    assert args["TORCH_VERSION"] in TORCH_CUDA_BUILDS, "add the torch release to the table"
    index = re.fullmatch(r"https://download\.pytorch\.org/whl/(cu\d+)", args["TORCH_INDEX_URL"])
    assert index is not None
    build = index.group(1)
    assert build in TORCH_CUDA_BUILDS[args["TORCH_VERSION"]], \
        f"torch {args['TORCH_VERSION']} has no {build} build"
    major, minor = args["CUDA_VERSION"].split(".")[:2]
    assert build == f"cu{major}{minor}", "the base image's toolkit must match torch's CUDA"
    text = DOCKERFILE_CUDA.read_text()
    assert "--no-build-isolation" in text


def test_makefile_gpu_targets_use_the_same_pairing() -> None:
    make = (ROOT / "Makefile").read_text()
    index = re.search(r"^TORCH_INDEX_URL \?= (\S+)$", make, re.M)
    assert index is not None and index.group(1) == _dockerfile_args()["TORCH_INDEX_URL"]
    assert "--no-build-isolation" in make and "test-gpu:" in make


# -- GPU packaging (issue 53) -----------------------------------------------------------------
def _pin(name: str) -> str:
    [pin] = re.findall(rf"^{re.escape(name)}==(\S+)$", (ROOT / "constraints.txt").read_text(),
                       re.M)
    return pin


def _stages() -> dict[str, str]:
    """Dockerfile.cuda's stages by name (the unnamed last one as ``""``), without comments,
    continuations joined."""
    text = re.sub(r"^#.*\n", "", DOCKERFILE_CUDA.read_text(), flags=re.M)
    text = re.sub(r"\s*\\\n\s*", " ", text)
    stages: dict[str, str] = {}
    for chunk in re.split(r"^(?=FROM )", text, flags=re.M)[1:]:
        m = re.match(r"FROM \S+(?: AS (\S+))?\n", chunk)
        assert m is not None, chunk.splitlines()[0]
        stages[m.group(1) or ""] = chunk
    return stages


def _python_c(stage: str, marker: str) -> str:
    """The one ``python -c`` script in the stage's RUN lines that contains ``marker``."""
    scripts = [argv[i + 1] for ln in stage.splitlines() if ln.startswith("RUN ")
               for argv in [shlex.split(ln[4:])] for i, a in enumerate(argv[:-1])
               if a == "-c" and argv[i - 1] == "python"]
    [script] = [s for s in scripts if marker in s]
    return script


def _pip_installs(stage: str) -> list[list[str]]:
    """The stage's ``pip install`` commands as argv (RUN lines split at ``&&``)."""
    runs = [ln[4:] for ln in stage.splitlines() if ln.startswith("RUN ")]
    return [shlex.split(cmd.split("|")[0]) for run in runs for cmd in run.split("&&")
            if cmd.split()[:2] == ["pip", "install"]]


def _requirements(argv: list[str]) -> list[str]:
    """What a ``pip install`` argv names to install (not its options or their values)."""
    out, skip = [], False
    for tok in argv[2:]:
        if skip:
            skip = False
        elif tok in ("-c", "-r", "--index-url"):
            skip = True
        elif not tok.startswith("-"):
            out.append(tok)
    return out


def test_flash_attn_is_pinned_once_and_built_in_its_own_stage() -> None:
    """One flash-attn version everywhere; the image compiles it (1-3 h, no wheel for torch 2.13)
    in a stage that takes nothing from the build context, so code edits keep its cached layer."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [req] = project["optional-dependencies"]["gpu"]
    pinned = re.fullmatch(r"flash-attn==(\d+\.\d+\.\d+\S*)", req)
    assert pinned is not None, f"the gpu extra must pin flash-attn exactly, not {req!r}"
    version = pinned.group(1)
    assert _pin("flash-attn") == version
    assert _dockerfile_args()["FLASH_ATTN_VERSION"] == version
    stages = _stages()
    assert list(stages) == ["torch", "flash-attn", "build", ""]
    flash = stages["flash-attn"]
    assert flash.startswith("FROM torch AS flash-attn\n"), "built against the image's torch"
    assert not re.search(r"^(COPY|ADD) ", flash, re.M), "nothing from the build context"
    assert re.search(r"pip wheel --no-build-isolation --no-deps --no-cache-dir --wheel-dir "
                     r'/wheels "flash-attn==\$\{FLASH_ATTN_VERSION\}"', flash)
    build = stages["build"]
    assert build.startswith("FROM torch AS build\n")
    assert "flash-attn" not in "".join(a for argv in _pip_installs(build) for a in argv)
    assert build.index("COPY --from=flash-attn /wheels") < build.index("\nCOPY . .")
    assert any("/wheels/flash_attn-*.whl" in argv for argv in _pip_installs(build))
    assert "pip wheel" not in build and "flash-attn" not in stages["torch"]


def test_cuda_image_installs_nixl_cu12_not_the_meta_package() -> None:
    """``nixl`` on PyPI is a meta package: it requires nixl-cu12 and nixl-cu13, and its only
    content is the ``nixl`` import name (nixl-cu12's wheel holds ``nixl_cu12``). The image takes
    nixl-cu12, the meta package without its dependencies, and the project's other dependencies
    from pyproject.toml less ``nixl`` (pip installs an installed package's missing requirements,
    so the project itself goes in with --no-deps)."""
    assert _pin("nixl-cu12") == _pin("nixl-cu13") == _pin("nixl")
    build = _stages()["build"]
    installs = _pip_installs(build)
    named = [(argv, req) for argv in installs for req in _requirements(argv)]
    assert any(req == "nixl-cu12" for _, req in named)
    for argv, req in named:
        assert "nixl-cu13" not in req and "nixl[" not in req
        if req == "nixl" or req.startswith("."):
            assert "--no-deps" in argv, f"{shlex.join(argv)} would bring nixl-cu13"
    assert build.index("COPY pyproject.toml constraints.txt") < build.index("\nCOPY . .")
    # The requirements list the image computes, computed here from the same script.
    script = _python_c(build, "tomllib")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert out == [d for d in deps if not re.match(r"nixl\b(?!-)", d)] and len(out) == \
        len(deps) - 1
    # pip check's filter lets the meta package's missing nixl-cu13 through, and nothing else.
    check = re.search(r"pip check (\|.*?)\n", build)
    assert check is not None
    for lines, ok in ((["No broken requirements found."], True),
                      (["nixl 1.5.1 requires nixl-cu13, which is not installed."], True),
                      (["nixl 1.5.1 requires nixl-cu12, which is not installed."], False),
                      (["ray 2.60.0 requires aiohttp, which is not installed."], False)):
        r = subprocess.run(["sh", "-c", f"printf '%s\\n' {shlex.join(lines)} {check.group(1)}"],
                           capture_output=True, text=True, timeout=30)
        assert (r.returncode == 0) == ok, (lines, r)


def test_cuda_image_asserts_which_nixl_build_loads() -> None:
    """The image's own checks, run here: this venv (the meta package's two builds, a CPU torch)
    is not the cu12 image, and each check must say so."""
    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch: this venv may be what the checks accept")
    build = _stages()["build"]
    for marker, want in (("must hold nixl-cu12 alone", "the cu12 image must hold nixl-cu12 alone"),
                         ("want nixl_cu12", "for torch CUDA : want nixl_cu12")):
        r = subprocess.run([sys.executable, "-c", _python_c(build, marker)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "NIXL_LOG_LEVEL": "WARN"})
        assert r.returncode != 0 and want in r.stderr, r.stderr


def test_make_test_gpu_runs_on_the_gpu_install() -> None:
    """``make test-gpu`` on a fresh or stale venv runs the CUDA install, never the CPU one (whose
    torch would not match the toolkit)."""
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-gpu: \$\(GPU_STAMP\)$", make, re.M)
    assert re.search(r"^install-gpu: \$\(GPU_STAMP\)$", make, re.M)
    if not shutil.which("make"):
        pytest.skip("no make on PATH")
    # Under `make test` the outer make's MAKEFLAGS/MAKELEVEL make this one print its directory.
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_INDEX_URL", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", "-B", "--no-print-directory", "test-gpu"], cwd=ROOT,
                         capture_output=True,
                         text=True, timeout=60, check=True, env=env).stdout
    index = _dockerfile_args()["TORCH_INDEX_URL"]
    assert f"--index-url {index} -c constraints.txt torch==" in out
    assert "-e '.[dev,gpu]'" in out and "--no-build-isolation" in out
    assert "-e '.[dev]'" not in out, "the CPU install ran for test-gpu"
    assert out.rstrip().endswith("pytest -q -ra tests/gpu")


def test_nixl_environment_report_comes_from_nixl_itself() -> None:
    """tests/gpu/test_environment.py's NIXL part (the wheel ships no ``ucx_info``), run here, in
    a process of its own (UCX hooks the allocator of the process that starts it)."""
    code = ("import json, runpy; print(json.dumps(runpy.run_path("
            f"{str(ROOT / 'tests' / 'gpu' / 'test_environment.py')!r})['nixl_report']()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NIXL_LOG_LEVEL": "WARN"})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])  # as gpu-report.json holds it
    assert "error" not in report, report
    assert report["nixl"] == _pin("nixl")
    assert report["build"] in ("nixl_cu12", "nixl_cu13")
    assert report[report["build"].replace("_", "-")] == importlib.metadata.version("nixl")
    if torch.version.cuda is not None:
        assert report["build"] == f"nixl_cu{torch.version.cuda.split('.')[0]}"
    assert "UCX" in report["plugins"]
    assert {"DRAM_SEG", "VRAM_SEG"} <= set(report["ucx_backend_mem_types"])
    assert "num_workers" in report["ucx_plugin_params"]
    # without ucm_cuda UCX takes VRAM for host memory (docs/gpu.md, the first smoke run)
    assert {"ucm_cuda", "uct_cuda", "uct_cma"} <= set(report["ucx_modules"]), report


def test_gpu_suite_is_not_collected_by_the_normal_suite() -> None:
    from conftest import collect_ignore

    if os.environ.get("KVRELAY_GPU_TESTS") != "1":
        assert "gpu" in collect_ignore


# -- the Kubernetes GPU overlay --------------------------------------------------------------
def _render(kustomization_dir: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl"):
        cmd = ["kubectl", "kustomize", str(kustomization_dir)]
    elif shutil.which("kustomize"):
        cmd = ["kustomize", "build", str(kustomization_dir)]
    else:
        pytest.skip("neither kubectl nor kustomize on PATH")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _workers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "Deployment"
            and d["metadata"]["labels"].get("app.kubernetes.io/component") in
            ("prefill", "decode")]


def test_gpu_overlay_requests_rdma_and_shm_and_adds_no_capability() -> None:
    """RDMA pinning needs the node's memlock limit, not IPC_LOCK (which a non-root container
    never holds, and which Pod Security restricted refuses)."""
    workers = _workers(_render(K8S / "overlays" / "gpu"))
    assert len(workers) == 2
    for dep in workers:
        pod = dep["spec"]["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "worker"]
        for side in ("requests", "limits"):
            res = c["resources"][side]
            assert res["nvidia.com/gpu"] == 1
            assert res["rdma/rdma_shared_device_a"] == 1
        caps = c["securityContext"]["capabilities"]
        assert caps == {"drop": ["ALL"]}
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert shm["emptyDir"]["sizeLimit"] == "16Gi"


def test_multus_component_annotates_only_workers(tmp_path: Path) -> None:
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel}/overlays/gpu\ncomponents:\n  - {rel}/components/multus-rdma\n")
    docs = _render(tmp_path)
    key = "k8s.v1.cni.cncf.io/networks"
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        notes = dep["spec"]["template"]["metadata"].get("annotations", {})
        assert (key in notes) == (dep in _workers(docs)), dep["metadata"]["name"]


def test_receiver_progress_runs_only_while_expecting() -> None:
    import threading
    import time

    from kvrelay.kv_transfer.errors import KVTransferError
    from kvrelay.kv_transfer.receiver_progress import ReceiverProgress

    calls: list[float] = []
    expecting = threading.Event()
    started = threading.Event()

    def progress() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise KVTransferError("a peer went away", retriable=True)  # must not kill it

    rp = ReceiverProgress(progress, expecting.is_set, 0.002, on_start=started.set)
    try:
        expecting.set()
        rp.kick()
        deadline = time.monotonic() + 5
        while len(calls) < 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert started.is_set() and len(calls) >= 10
        expecting.clear()
        time.sleep(0.05)
        n = len(calls)
        time.sleep(0.05)
        assert len(calls) == n  # idle: asleep on its event, no polling
    finally:
        rp.close()


# -- paged flash-attn ------------------------------------------------------------------------
def test_paged_flash_block_size() -> None:
    from kvrelay.engine.cuda.memory import paged_flash_block_size

    assert paged_flash_block_size(16) == 256
    assert paged_flash_block_size(256) == 256
    assert paged_flash_block_size(512) == 512


def test_flash_metadata_paged_and_gather(demo_model_dir: str) -> None:
    """The flash-attn backend's view of a step the runner laid out: block tables for the paged
    kernel, else the gathered slots; both name the same visible keys."""
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.cuda.flash import FlashBackend
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence

    core = EngineCore(EngineConfig.from_kwargs(demo_model_dir, block_size=16, num_blocks=64,
                                               attention_backend="sdpa"))
    runner, bm = core.runner, core.block_manager
    seqs = [Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams()) for i, n in
            enumerate((40, 5, 17))]
    for s in seqs:
        assert bm.allocate(s, len(s.token_ids))
    seqs[1].num_computed_tokens = 4  # a decode over 4 cached tokens
    sched = [ScheduledSeq(seqs[0], 40), ScheduledSeq(seqs[2], 17), ScheduledSeq(seqs[1], 1)]
    metas = {}
    for paged in (False, True):
        runner.attention = FlashBackend(paged=paged)
        metas[paged] = runner.prepare(sched).meta
    gather, paged_meta = metas[False], metas[True]
    assert paged_meta.gather_slots is None and gather.flash_block_table is None
    table = paged_meta.flash_block_table
    assert table is not None and table.dtype == torch.int32 and table.shape == (3, 3)
    k_lens = torch.diff(paged_meta.cu_seqlens_k).tolist()
    assert k_lens == [40, 17, 5]  # row order: the prefill chunks, then the decode
    slots = torch.cat([(table[j, :-(-k // 16)].long()[:, None] * 16 + torch.arange(16))
                       .flatten()[:k] for j, k in enumerate(k_lens)])
    assert torch.equal(slots, gather.gather_slots)
    for s in seqs:
        bm.free(s)
