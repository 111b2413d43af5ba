"""Request values at the edges of the types that carry them, checked where they enter (no
cluster: the end-to-end checks are in test_fuzz_limits.py)."""

from __future__ import annotations

import math
import struct

import pytest

from kvrelay.common.convert import sampling_from_proto, sampling_to_proto
from kvrelay.common.limits import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import generate_pb2 as pb


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_stop_token_ids_are_a_set() -> None:
    sp = SamplingParams(stop_token_ids=[5, 7, 5])
    assert isinstance(sp.stop_token_ids, frozenset) and sp.stop_token_ids == {5, 7}
    assert sp == SamplingParams(stop_token_ids=(7, 5))


@pytest.mark.parametrize("t", [5e-324, 1e-45, 1e-40, 1e-30, 1e-3])
def test_tiny_temperature_is_raised_to_the_minimum(t: float) -> None:
    sp = SamplingParams(temperature=t)
    assert sp.temperature == SamplingParams.MIN_TEMPERATURE and not sp.greedy
    # ... and stays there through the float32 field to the workers
    back = sampling_from_proto(sampling_to_proto(sp))
    assert back.temperature == SamplingParams.MIN_TEMPERATURE
    assert _f32(sp.temperature) > 0 and math.isfinite(10.0 / _f32(sp.temperature))


@pytest.mark.parametrize("p", [5e-324, 1e-50, 1e-45, 1e-40])
def test_tiny_top_p_survives_float32(p: float) -> None:
    sp = SamplingParams(top_p=p)
    assert sp.top_p == SamplingParams.MIN_TOP_P
    assert sampling_from_proto(sampling_to_proto(sp)).top_p == SamplingParams.MIN_TOP_P


@pytest.mark.parametrize("kw", [
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -math.inf},
    {"top_p": math.nan}, {"top_p": math.inf}, {"top_p": 0.0}, {"top_k": 2**31},
    {"top_k": 2**63}, {"top_k": -2}, {"seed": 2**63}, {"stop_token_ids": [2**32]},
    {"stop_token_ids": [-1]}])
def test_values_past_their_wire_type_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_edge_values_that_fit_pass_the_wire() -> None:
    sp = SamplingParams(top_k=2**31 - 1, seed=2**63 - 1, stop_token_ids=[2**32 - 1])
    assert sampling_from_proto(sampling_to_proto(sp)) == sp


def test_proto_lists_are_counted_before_they_are_copied() -> None:
    msg = pb.SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(ValueError, match="at most"):
        sampling_from_proto(msg)
    msg = pb.SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="at most"):
        sampling_from_proto(msg)
