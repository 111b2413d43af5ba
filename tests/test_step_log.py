"""The engine's step log (``KVRELAY_STEP_LOG``) and its summary (``bench/serving/step_log.py``):
one line
per step with its shape, bursts told apart, steps counted by kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving.step_log import busiest_burst, summary
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.step_log import ENV, StepLog, read
from kvrelay.engine.step_log import StepRecord as Step

ROOT = Path(__file__).resolve().parent.parent


def test_an_engine_logs_every_step_with_its_shape(demo_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "steps"))
    llm = LLM(demo_model_dir, num_blocks=64, num_threads=1)
    [log] = tmp_path.glob("steps.*")
    assert log.read_text() == ""
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(10, 30)), list(range(40, 52))], [sp, sp])
    steps = read(log)
    # One prefill step of both prompts (it samples each one's first token), then three steps
    # of two decodes.
    assert [(s.prefill_tokens, s.decodes) for s in steps] == [(32, 0)] + [(0, 2)] * 3
    assert all(s.seconds > 0 for s in steps)
    assert [s.start for s in steps] == sorted(s.start for s in steps)
    assert "decode only:     3 steps" in summary(steps)
    llm.engine.step_log.close()


def test_the_busiest_burst_is_the_run_not_its_warmup() -> None:
    warm = [Step(0.0, 0.1, 64, 2080, 0, 0), Step(0.1, 0.01, 0, 0, 1, 65)]
    run = [Step(5.0, 0.2, 512, 131328, 0, 0), Step(5.2, 0.02, 0, 0, 4, 2052),
           Step(5.8, 0.02, 0, 0, 4, 2056)]
    assert busiest_burst(warm + run, gap=1.0) == run
    assert busiest_burst(warm + run, gap=0.3) == run[:2]
    assert busiest_burst([], gap=1.0) == []
    assert summary([]) == "no steps"


@pytest.mark.parametrize("value", ["", None])
def test_no_log_unless_asked(monkeypatch, value) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert StepLog.from_env() is None
