"""Tensor parallelism's two kinds of collective (engine/tp_shard.py): activations on ``group``
(NCCL on GPUs), control on ``control`` (gloo, CPU tensors). On a GPU replica a control message
over NCCL crashes at start (NCCL takes CUDA tensors only, seen on an H200): here, on the CPU,
every control path is shown to take the control group, and a CPU tensor headed for an NCCL
group is refused before it gets there."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvrelay.engine.model_runner import ModelRunner
from kvrelay.engine.tp_shard import TensorParallelError, TPShard, make_groups

TIMEOUT = datetime.timedelta(seconds=30)


class _Work:
    def wait(self, *args: Any) -> bool:
        return True


class SpyGroup:
    """Records the collectives it is asked for (and of which device's tensors)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self.calls += [("allreduce", t.device.type) for t in tensors]
        return _Work()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self.calls += [("broadcast", t.device.type) for t in tensors]
        return _Work()


def _gpu_like_shard() -> tuple[TPShard, SpyGroup, SpyGroup]:
    activations, control = SpyGroup(), SpyGroup()
    return TPShard(0, 2, activations, TIMEOUT, control, nccl=True), activations, control  # type: ignore[arg-type]


def test_a_cpu_tensor_never_reaches_the_nccl_group() -> None:
    shard, activations, _ = _gpu_like_shard()
    with pytest.raises(TensorParallelError, match="would reach an NCCL collective"):
        shard.all_reduce(torch.ones(4))
    assert activations.calls == []


def test_control_messages_take_the_control_group() -> None:
    shard, activations, control = _gpu_like_shard()
    shard.broadcast(torch.zeros(8, dtype=torch.long))  # the packed step
    shard.control_all_reduce(torch.tensor([4, -4]), dist.ReduceOp.MAX)
    assert control.calls == [("broadcast", "cpu"), ("allreduce", "cpu")]
    assert activations.calls == []


def test_the_block_count_check_is_a_control_collective() -> None:
    """``ModelRunner.check_blocks`` (every rank at start): over gloo, never NCCL."""
    shard, activations, control = _gpu_like_shard()

    class Runner:
        kv_spec = type("Spec", (), {"num_blocks": 12})()

    Runner.shard = shard  # type: ignore[attr-defined]
    ModelRunner.check_blocks(Runner(), TIMEOUT)  # type: ignore[arg-type]
    assert control.calls == [("allreduce", "cpu")] and activations.calls == []


def test_cpu_groups_are_one_gloo_group_that_works() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)
    group, control = make_groups(store, 0, 1, TIMEOUT, torch.device("cpu"))
    assert control is None
    shard = TPShard(0, 1, group, TIMEOUT)
    x = torch.full((3,), 2.0)
    shard.all_reduce(x)
    shard.control_all_reduce(x)
    shard.broadcast(x)
    assert torch.equal(x, torch.full((3,), 2.0))
