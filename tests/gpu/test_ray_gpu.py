"""``kvrelay serve --device auto`` on an embedded Ray of a GPU machine: its replicas ask for a GPU
and their engines land on CUDA (before issue 24 they asked for none and ran fp32 on the CPU)."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module")
def ray_session():
    from kvrelay.deploy.ray_cli import init_ray

    pytest.importorskip("ray")
    assert init_ray(None, num_cpus=8, object_store_memory="256MiB")
    ray = sys.modules["ray"]
    yield ray
    ray.shutdown()


def test_auto_asks_for_gpus_and_workers_see_cuda(ray_session, hf_model_dir) -> None:
    from kvrelay.cli import build_parser
    from kvrelay.deploy.ray_cli import build_spec

    ray = ray_session
    args = build_parser().parse_args(["serve", "--model", hf_model_dir("llama"),
                                      "--http-port", "-1"])
    spec = build_spec(args, True, ray.cluster_resources())
    assert ray.cluster_resources().get("GPU", 0) >= 1
    assert spec.pools["prefill"].gpus == spec.pools["decode"].gpus == 1.0
    assert spec.engine.model.device == "cuda"

    @ray.remote(num_gpus=spec.pools["decode"].gpus, num_cpus=0)
    def engine_device(name: str) -> str:
        from kvrelay.engine.device import resolve_device

        return str(resolve_device(name))

    assert ray.get(engine_device.remote(spec.engine.model.device)).startswith("cuda")

    @ray.remote(num_gpus=0, num_cpus=0)
    def hidden(name: str) -> str:
        from kvrelay.engine.device import resolve_device

        try:
            return str(resolve_device(name))
        except RuntimeError as e:
            return f"refused: {e}"

    # A replica that asked for no GPU must refuse cuda, not fall back to the CPU.
    assert ray.get(hidden.remote("cuda")).startswith("refused")
