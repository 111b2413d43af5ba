"""The online choice of the GEMM's next-panel prefetch (engine/cpu/prefetch_tuner.py): its probes
pick the faster arm from paired step times, follow a change of the memory's phase, leave other steps
on the fixed choice, and change no token."""

from __future__ import annotations

import dataclasses

import pytest

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.cpu import gemm
from kvrelay.engine.cpu.prefetch_tuner import PATTERN, PrefetchChoices, PrefetchTuner
from kvrelay.engine.engine_core import EngineCore, EngineStats
from kvrelay.engine.sampling_params import SamplingParams

BASE = 10  # the Zen 4's fixed choice: calls of 10 rows and more prefetch


class Host:
    """A fake host: a clock, and step times that depend on the arm the kernel was given."""

    def __init__(self, on: float, off: float) -> None:
        self.t = 0.0
        self.times = {True: on, False: off}
        self.applied: list[int] = []

    def apply(self, pf_min_rows: int) -> None:
        self.applied.append(pf_min_rows)

    def step(self, tuner: PrefetchTuner, rows: int, dt: float = 0.01) -> bool:
        """One decode step of ``rows`` rows; returns whether it prefetched."""
        tuner.begin(rows)
        on = self.applied[-1] <= rows
        tuner.end(self.times[on] * (1 + 0.001 * (len(self.applied) % 3)))  # a little noise
        self.t += dt
        return on


def make(host: Host, **kw: float) -> PrefetchTuner:
    return PrefetchTuner(BASE, host.apply, clock=lambda: host.t, **kw)


@pytest.mark.parametrize("on, off, want", [(0.95, 1.0, True), (1.1, 1.0, False)])
def test_the_first_probe_picks_the_faster_arm(on: float, off: float, want: bool) -> None:
    host = Host(on, off)
    tuner = make(host)
    arms = [host.step(tuner, 8) for _ in range(len(PATTERN))]
    assert arms == list(PATTERN)  # the probe's ABBA order, from the first step of a size
    assert tuner.choices() == {8: want} and tuner.num_probes == 1
    assert [host.step(tuner, 8) for _ in range(20)] == [want] * 20
    # Arms are thresholds that change nothing but this size: on lowers it to 8, off keeps 10.
    assert host.applied[-1] == (8 if want else BASE)


def test_a_phase_change_is_measured_again() -> None:
    host = Host(0.95, 1.0)
    tuner = make(host)
    for _ in range(20):
        host.step(tuner, 8)
    assert tuner.choices() == {8: True}
    host.times = {True: 1.40, False: 1.25}  # the memory slowed down: now the prefetch hurts
    # Two steps far from the mean start a probe, once 0.5 s have passed since the last one
    # (which ended at 0.07 s).
    assert host.t == pytest.approx(0.2)
    assert [host.step(tuner, 8) for _ in range(37)] == [True] * 37
    assert [host.step(tuner, 8) for _ in range(len(PATTERN))] == list(PATTERN)
    assert tuner.choices() == {8: False} and tuner.num_probes == 2
    # One odd step alone does not.
    host.times[False] = 1.6
    host.step(tuner, 8)
    host.times[False] = 1.25
    assert [host.step(tuner, 8) for _ in range(5)] == [False] * 5
    assert tuner.num_probes == 2


def test_probes_recur_every_period_and_restart_when_left_unfinished() -> None:
    host = Host(0.95, 1.0)
    tuner = make(host, period_s=1.0, probe_timeout_s=0.5)
    for _ in range(len(PATTERN)):
        host.step(tuner, 8)
    host.t += 1.0
    assert host.step(tuner, 8) is PATTERN[0] and host.step(tuner, 8) is PATTERN[1]
    assert tuner.num_probes == 1
    host.t += 0.6  # the batch ran at another size meanwhile: this probe starts over
    assert [host.step(tuner, 8) for _ in range(len(PATTERN))] == list(PATTERN)
    assert tuner.num_probes == 2


def test_other_steps_keep_the_fixed_choice() -> None:
    host = Host(0.95, 1.0)
    tuner = make(host, max_rows=16)
    for _ in range(len(PATTERN)):
        host.step(tuner, 4)
    assert host.applied[-1] == 4  # prefetching at 4 rows
    tuner.skip()  # a step with prefill chunks
    assert host.applied[-1] == BASE
    tuner.end(5.0)  # not recorded anywhere
    for rows in (1, 17):  # outside min_rows..max_rows: fixed, and never probed
        host.step(tuner, rows)
        assert host.applied[-1] == BASE
    assert tuner.choices() == {4: True}
    assert tuner.sizes[4].mean == pytest.approx(0.95, rel=0.01)


@pytest.mark.skipif(not gemm.available(), reason="no native panel GEMM here")
def test_set_prefetch_min_rows_changes_only_that_field() -> None:
    before = gemm.tuning()
    picked = gemm.picked_tuning()
    try:
        gemm.tuning(dataclasses.replace(before, pack_min_k=777))
        gemm.set_prefetch_min_rows(3)
        assert gemm.tuning() == dataclasses.replace(before, pack_min_k=777, pf_min_rows=3)
        assert gemm.picked_tuning() == picked  # what a new engine's tuner takes as its base
    finally:
        gemm.tuning(before)


@pytest.mark.skipif(not gemm.available(), reason="no native panel GEMM here")
def test_an_engine_probing_every_step_decodes_the_same_tokens(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(probing: bool) -> tuple[dict[str, list[int]], PrefetchTuner | None]:
        core = EngineCore(EngineConfig.from_kwargs(
            model_dir, block_size=8, num_blocks=256, max_num_batched_tokens=64, seed=0,
            linear_kernel="panels", attention_backend="native"))
        fused = core.runner.model.fused_decode
        assert fused is not None
        tuner = None
        if probing:  # on any CPU, whatever the kernel makes of the threshold
            fused.tuner = tuner = PrefetchTuner(gemm.picked_tuning().pf_min_rows,
                                                gemm.set_prefetch_min_rows, period_s=0.0)
        else:
            fused.tuner = None
        for i, n in enumerate((3, 7, 12, 20)):
            core.add_request(f"r{i}", list(range(5, 5 + n)), greedy)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        while core.has_unfinished():
            for o in core.step():
                got[o.request_id] += o.new_token_ids
        snap = core.stats().gemm_prefetch
        assert (snap is None) if tuner is None else (snap == PrefetchChoices(
            tuner.choices(), tuner.num_probes))
        core.add_request("next", list(range(5, 40)), greedy)
        core.step()  # its prefill: on the CPU's fixed choice again
        if tuner is not None:
            assert gemm.tuning().pf_min_rows == gemm.picked_tuning().pf_min_rows
        return got, tuner

    plain, _ = generate(False)
    tuned, tuner = generate(True)
    assert tuned == plain
    assert tuner is not None and tuner.num_probes >= 2 and 4 in tuner.choices()


def test_the_worker_exports_the_choices() -> None:
    from prometheus_client import generate_latest

    from kvrelay.worker.metrics import WorkerMetrics

    stats = EngineStats(**{f.name: {} if str(f.type).startswith("dict") else 0
                             for f in dataclasses.fields(EngineStats)})
    stats = dataclasses.replace(stats, num_blocks=1, step_cost=None, kv_transfer={},
                                gemm_prefetch=PrefetchChoices({1: False, 8: True}, 5))
    text = generate_latest(WorkerMetrics(lambda: stats, "decode", "w").registry).decode()
    gauge = "kvrelay:gemm_next_panel_prefetch"
    assert f'{gauge}{{pool="decode",rows="1",worker="w"}} 0.0' in text
    assert f'{gauge}{{pool="decode",rows="8",worker="w"}} 1.0' in text
    assert 'kvrelay:gemm_prefetch_probes_total{pool="decode",worker="w"} 5.0' in text
    # An engine without a tuner exports neither.
    text = generate_latest(WorkerMetrics(lambda: dataclasses.replace(stats, gemm_prefetch=None),
                                         "decode", "w").registry).decode()
    assert "gemm_next_panel_prefetch" not in text and "gemm_prefetch_probes" not in text
