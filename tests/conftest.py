"""Shared fixtures: the tiny demo checkpoint and tiny HF checkpoints of each architecture.

Everything is built lazily on first use (once per session) in a temporary directory, and offline:
collection imports nothing heavy.

    def test_parity(hf_model_dir):
        model_dir = hf_model_dir("llama3")               # see hf_models.ARCHS
        sharded = hf_model_dir("llama", max_shard_size="200KB")  # overrides: their own copy
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# The tests' Ray is always embedded and loopback-only; Ray reads this when it is first imported,
# which may be a module that only builds a deployment spec, before any test starts a Ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# One intra-op thread per test process (torch reads this when first imported, which is after
# this file): `make test` runs two test processes beside the clusters' workers on a 2-core host,
# and two-thread OpenMP regions that spin at their barriers while the other process holds a core
# ran the engine modules ~1.5-2.8x slower than one thread each (test_moe_models, test_bf16_engine
# and test_engine_parity under -n 2: 128-234 s with two threads each, 82 s with one). A test
# that needs two threads says so (the ``two_threads`` fixture); the cluster harness's workers
# already run one (``kvrelay.forking.BASE_ENV``).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The GPU smoke suite runs by itself (`make test-gpu`), never inside the normal suite.
collect_ignore = [] if os.environ.get("KVRELAY_GPU_TESTS") == "1" else ["gpu"]


# Session fixtures a few modules share, and those modules (collection checks the lists against
# the fixtures their tests use). Under pytest-xdist each group is one unit of work, handed out
# before the other files, so one process starts the fixture once; and in any run the fixture
# stops when the group's last test ends, not with the session, so that no idle Ray or cluster
# runs beside the rest of the suite (an idle 1P1D on Ray costs 12 % of a core, the API cluster
# 5 %). The modules on Ray run in this order (test_ray starts from the fresh cluster); in one
# process they run last.
SHARED = {
    # ray_served stops with it; tests/gpu/test_ray_gpu.py only under `make test-gpu`
    "ray_session": ("test_ray.py", "test_planner_live.py", "test_ray_tp.py", "test_ray_gpu.py"),
    "api_cluster": ("test_coalesce_cluster.py", "test_fuzz_limits.py", "test_maximal_bodies.py",
                    "test_n_cluster.py", "test_sampling_cluster.py",
                    "test_structured_cluster.py"),
}
ON_RAY = SHARED["ray_session"]
_GROUP = {module: fixture for fixture, modules in SHARED.items() for module in modules}
# Each test file's seconds in the last run that ran it (pytest's cache, where it is on): under
# pytest-xdist the longest files are handed out first, so that the two processes end together.
FILE_SECONDS = "kvrelay/file_seconds"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for it in items:
        for fixture in SHARED:
            if fixture in getattr(it, "fixturenames", ()) and _GROUP.get(it.path.name) != fixture:
                raise pytest.UsageError(f"{it.path.name} uses the session fixture {fixture}: "
                                        f"list it in tests/conftest.py's SHARED[{fixture!r}]")

    def rank(it: pytest.Item) -> int:  # each group together, the Ray modules last, in order
        name = it.path.name
        return 2 + ON_RAY.index(name) if name in ON_RAY else (1 if name in _GROUP else 0)
    items.sort(key=rank)  # stable: modules stay whole, in order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        fixture = _GROUP.get(item.path.name)
        # (Other pytest-xdist modes interleave a group's tests with other files': there the
        # fixture lives on, as before, rather than start again after each interruption.)
        if fixture and nextitem is not None and _GROUP.get(nextitem.path.name) != fixture \
                and item.config.getoption("dist", "no") in ("no", "loadfile"):
            _finish_early(item, fixture)


def _finish_early(item: pytest.Item, fixture: str) -> None:
    """Tear ``fixture`` (session-scoped) down now, as the session's end would (what depends on
    it first); a later test that asks for it would start it again. This reaches into pytest
    (its fixture definitions, the item's request): where those changed, the fixture lives to
    the session's end, as any session fixture does."""
    try:
        defs = item.session._fixturemanager.getfixturedefs(fixture, item)
        request = item._request
    except AttributeError:
        return
    if defs:
        defs[-1].finish(request)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may be off (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with each group of ``SHARED`` as one unit, handed out first, and then
    the longest files first (by their seconds in the last run; without them, the files of most
    tests first, as pytest-xdist orders them). pytest-xdist's own order had split the Ray modules
    over both processes, each starting a Ray and a cluster (24 s of setup), left the first Ray
    idle under the rest of the suite, and ran the 1-test planner module last, beside an idle
    process (2026-11-29: 50 s, 64 s after the other process ran out of files)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    seconds: dict[str, float] = cache.get(FILE_SECONDS, {}) if cache else {}
    groups = list(SHARED)

    class LongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            fixture = _GROUP.get(path.rsplit("/", 1)[-1])
            return f"the modules of {fixture}" if fixture else path

        def _cost(self, scope: str) -> tuple[int, float, int]:
            tests = self.workqueue[scope]
            first = next((len(groups) - i for i, g in enumerate(groups) if scope.endswith(g)), 0)
            return (first, sum(seconds.get(t.split("::", 1)[0], 0.0) for t in tests),
                    len(tests))

        def _assign_work_unit(self, node: Any) -> None:
            self.workqueue.move_to_end(max(self.workqueue, key=self._cost), last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = getattr(session.config, "cache", None)
    if cache is None or hasattr(session.config, "workerinput") or not _file_seconds:
        return  # (each xdist process reports its tests to the controller, which keeps them)
    kept = cache.get(FILE_SECONDS, {})
    kept.update({k: round(v, 2) for k, v in _file_seconds.items()})
    cache.set(FILE_SECONDS, kept)


@pytest.fixture(scope="session", autouse=True)
def _worker_fork_server() -> None:
    """The cluster harness's fork server for workers (``kvrelay.forking``) starts before anything
    else uses this process's fork server: in-process tensor parallelism and the KV-transfer
    test processes share it, and it must import torch under the workers' environment for the
    harness to fork workers from it. Its imports run in its own process, beside collection."""
    from kvrelay.forking import start_fork_server

    start_fork_server()


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch (and the native kernels it hands its thread count to) on two threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny demo checkpoint, written in fp32 (``write_demo_model(size="tiny", seed=0,
    dtype="float32")``). The suite's many exactness checks compare tokens with transformers in
    fp32, which a bf16 KV cache cannot promise where the top-2 margin is under ~0.5 % of the
    logit range (on this random-weight model, a 17-token prompt's first token is at 0.31 %).
    The bf16 path has its own tests (``demo_bf16_dir``, test_bf16_*)."""
    from kvrelay.engine.demo_model import write_demo_model

    return write_demo_model(str(tmp_path_factory.mktemp("demo-tiny")), size="tiny", seed=0,
                            dtype="float32")


@pytest.fixture(scope="session")
def demo_bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny demo checkpoint as ``kvrelay demo-model`` writes it by default: bf16."""
    from kvrelay.engine.demo_model import write_demo_model

    return write_demo_model(str(tmp_path_factory.mktemp("demo-bf16")), size="tiny", seed=0)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """A factory ``hf_model_dir(arch, **overrides) -> checkpoint dir``, cached per arguments."""
    from hf_models import make_hf_model

    cache: dict[str, str] = {}

    def get(arch: str, **overrides: Any) -> str:
        key = arch + "".join(f",{k}={v!r}" for k, v in sorted(overrides.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"hf-{arch}")
            cache[key] = make_hf_model(str(out), arch, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def api_cluster(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """One disaggregated cluster (1 prefill, 2 decode, the OpenAI HTTP API as model "demo")
    shared by the API feature modules (n > 1, sampling, structured output): one start-up
    instead of one per module. Modules take it through a fixture that calls
    ``ensure_workers(prefill=1, decode=2)``, which replaces a worker an earlier module killed."""
    from cluster import Cluster

    c = Cluster(demo_model_dir, tmp_path_factory.mktemp("api"), prefill=1, decode=2,
                router_args=("--http-port", "0", "--served-model-name", "demo"))
    with c:
        yield c


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """The embedded Ray (``ray_harness.embedded_ray``), one for the modules that run on Ray
    (``SHARED``: stopped when the last of them ends)."""
    from ray_harness import embedded_ray

    yield from embedded_ray()


@pytest.fixture(scope="session")
def ray_served(ray_session: Any, demo_model_dir: str) -> Iterator[Any]:
    """One ``kvrelay serve`` (1P1D of the demo model, started as the CLI starts it) on the
    session's Ray, shared by its modules: each leaves it at 1P1D with no policy on."""
    from ray_harness import Served, serve_args

    from kvrelay.deploy.launcher import start
    from kvrelay.deploy.ray_cli import build_spec

    spec = build_spec(serve_args(demo_model_dir), loopback=True)
    assert spec.worker.cluster_token  # generated: no --cluster-token was given
    handle, info = start(spec)
    try:
        yield Served(handle, info, ray_session.get_runtime_context().gcs_address,
                     spec.worker.cluster_token)
    finally:
        handle.shutdown()
