"""KV layout handshake and the control-plane messages of kv_transfer (no NIXL needed)."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import (
    PROTOCOL_VERSION,
    IncompatibleKVLayout,
    KVLayout,
    check_compatible,
    model_identity,
)
from kvrelay.kv_transfer.messages import KVDestination, KVExpectation, PeerInfo

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=100)


def layout(**kw) -> KVLayout:
    base = dict(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=100,
                dtype="float32", model_id="m-1", device_kind="cpu")
    return KVLayout(**{**base, **kw})


def test_layout_round_trips_through_bytes_and_dict() -> None:
    lay = KVLayout.from_spec(SPEC, "m-1")
    assert lay == layout() and lay.spec == SPEC and lay.version == PROTOCOL_VERSION
    assert KVLayout.from_bytes(lay.to_bytes()) == lay
    assert KVLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


def test_num_blocks_may_differ() -> None:
    check_compatible(layout(), layout(num_blocks=7))


@pytest.mark.parametrize(("field", "theirs", "expected"), [
    ("block_size", 32, "peer has block_size 32, we have 16: start both pools with the same "
                       "--block-size"),
    ("dtype", "bfloat16", "peer stores KV as bfloat16, we have float32: start both pools with "
                          "the same --kv-cache-dtype"),
    ("model_id", "m-2", "peer serves model m-2, we have m-1: start both pools with the same "
                        "--model"),
    ("num_kv_heads", 8, "peer has num_kv_heads 8, we have 2"),
    ("device_kind", "cuda", "peer keeps KV on cuda, we have cpu: start both pools with the same "
                            "--device"),
])
def test_each_difference_is_named_with_the_flag_that_fixes_it(field, theirs, expected) -> None:
    with pytest.raises(IncompatibleKVLayout) as ei:
        check_compatible(layout(), layout(**{field: theirs}), peer="decode-3")
    assert expected in str(ei.value) and "'decode-3'" in str(ei.value)
    assert isinstance(ei.value, KVTransferError) and not ei.value.retriable


def test_all_differences_are_listed_at_once() -> None:
    with pytest.raises(IncompatibleKVLayout) as ei:
        check_compatible(layout(), layout(block_size=8, head_dim=128))
    assert "block_size 8" in str(ei.value) and "head_dim 128" in str(ei.value)


def test_another_protocol_version_is_refused_before_reading_fields() -> None:
    d = layout().to_dict() | {"version": PROTOCOL_VERSION + 1, "new_field": 1}
    with pytest.raises(IncompatibleKVLayout, match="same kvrelay version"):
        KVLayout.from_dict(d)


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match="model_id"):
        layout(model_id="")
    with pytest.raises(ValueError, match="device_kind"):
        layout(device_kind="tpu")
    with pytest.raises(ValueError, match="dtype"):
        layout(dtype="int8")


def test_peer_info_round_trips_as_bytes() -> None:
    info = PeerInfo("decode-0", b"\x00md\xffbytes", layout(), 0x7F00_0000_1000, 0, "inc-1")
    data = info.to_bytes()
    assert isinstance(data, bytes) and data.startswith(b"KVRP")
    assert PeerInfo.from_bytes(data) == info
    with pytest.raises(ValueError, match="bad magic"):
        PeerInfo.from_bytes(b"junk" + data[4:])
    with pytest.raises(ValueError, match="truncated"):
        PeerInfo.from_bytes(data[:12])


def test_destination_and_expectation_validate() -> None:
    d = KVDestination("decode-0", [4, 5, 6], 1, b"lease-1")
    assert d.remote_block_ids == (4, 5, 6)
    with pytest.raises(ValueError, match="skip_blocks"):
        KVDestination("decode-0", [4], 2, b"x")
    with pytest.raises(ValueError, match="notif"):
        KVDestination("decode-0", [4], 0, b"")
    with pytest.raises(ValueError, match="peer"):
        KVDestination("", [4], 0, b"x")
    assert KVExpectation("lease-1").notif == b"lease-1"
    with pytest.raises(ValueError, match="timeout_s"):
        KVExpectation(b"x", timeout_s=0)


def test_errors_keep_their_flags_through_pickle() -> None:
    e = pickle.loads(pickle.dumps(KVTransferError("gone", retriable=True, peer="p")))
    assert (str(e), e.retriable, e.peer) == ("gone", True, "p")
    e2 = pickle.loads(pickle.dumps(IncompatibleKVLayout("bad", peer="p")))
    assert isinstance(e2, IncompatibleKVLayout) and not e2.retriable


def test_model_identity_tells_weights_apart(tmp_path) -> None:
    for name, weights in (("a", b"\x01" * 1000), ("b", b"\x02" * 1000), ("c", b"\x01" * 1000)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2}))
        (d / "model.safetensors").write_bytes(weights)
    ids = [model_identity(str(tmp_path / n)) for n in "abc"]
    assert ids[0] == ids[2] != ids[1] and len(ids[0]) == 16


def test_the_transport_without_nixl_is_a_clear_import_error(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "kvrelay.kv_transfer.nixl_transport", raising=False)
    monkeypatch.setitem(sys.modules, "nixl._bindings", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(ImportError, match="pip install nixl"):
        import kvrelay.kv_transfer.nixl_transport  # noqa: F401
