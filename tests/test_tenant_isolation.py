"""What one client (API key) may learn of or take from another at the router's public ports
(issue 54): the public gRPC server's concurrent calls are bounded, request ids are scoped by API
key, the prefix cache is salted per key by default once keys are set, and a client's
``traceparent`` is checked before the router's trace continues it.

The real router in this process with no workers (``router_in_process``): a request that passes
validation waits for a worker (``worker_wait_s``) and then fails UNAVAILABLE, which is what holds
a call open here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from router_in_process import RouterInProcess

from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc
from kvrelay.router.requests import RouterConfig

KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def router(demo_model_dir: str) -> Iterator[RouterInProcess]:
    with RouterInProcess(demo_model_dir, api_keys=KEYS, max_concurrent_rpcs=3,
                         config=RouterConfig(worker_wait_s=60.0)) as r:
        yield r
        assert not r.errors, [rec.getMessage() for rec in r.errors[:5]]


def _md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _request(rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hello there", request_id=rid,
                              sampling=pb.SamplingParams(max_tokens=2))


def _wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_public_grpc_server_bounds_its_concurrent_calls(router) -> None:
    """Calls past the limit are RESOURCE_EXHAUSTED with retry-after-ms at once, before their
    handler runs; health checks still answer; the calls' places come back when they end."""
    limit = router.router.call_limit
    with grpc.insecure_channel(router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        held = [stub.Generate(_request(), metadata=_md("key-a"), timeout=60)
                for _ in range(limit.limit)]
        try:
            _wait_for(lambda: limit.active == limit.limit, "calls not held")
            t = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_request(), metadata=_md("key-b"), timeout=30))
            assert time.monotonic() - t < 5  # refused, not queued behind the held calls
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "calls in progress" in e.value.details()
            assert int(dict(e.value.trailing_metadata())["retry-after-ms"]) > 0
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(pb.ListModelsRequest(), metadata=_md("key-b"), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
            assert health.status in (health_pb2.HealthCheckResponse.SERVING,
                                     health_pb2.HealthCheckResponse.NOT_SERVING)
        finally:
            for call in held:
                call.cancel()
        _wait_for(lambda: limit.active == 0, "cancelled calls kept their places")
        models = stub.ListModels(pb.ListModelsRequest(), metadata=_md("key-b"), timeout=30)
        assert models.models


def test_request_ids_are_scoped_by_api_key(router) -> None:
    """A request id in flight under one key is free under another: an ALREADY_EXISTS would tell
    one tenant which ids another uses. Under its own key the id is still taken."""
    with grpc.insecure_channel(router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        held = stub.Generate(_request("shared-id"), metadata=_md("key-a"), timeout=60)
        try:
            _wait_for(lambda: router.router.service.inflight == 1, "not in flight")
            # key-b's request with the same id is accepted: it waits for a worker like any
            # other (this module's router has none), until its own deadline.
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_request("shared-id"), metadata=_md("key-b"), timeout=3))
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(_request("shared-id"), metadata=_md("key-a"), timeout=30))
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
        finally:
            held.cancel()
    _wait_for(lambda: router.router.service.inflight == 0, "request kept its slot")


def test_the_prefix_cache_is_salted_per_key_by_default_when_keys_are_set(router,
                                                                        demo_model_dir) -> None:
    service = router.router.service
    assert service.cache_salt_by_api_key
    a, b = service.cache_salt(None, "key-a"), service.cache_salt(None, "key-b")
    assert a and b and a != b and "key-a" not in a
    assert service.cache_salt("s", "key-a") not in (a, service.cache_salt("s", "key-b"))
    with RouterInProcess(demo_model_dir) as open_router:  # no keys: nothing to salt by
        assert not open_router.router.service.cache_salt_by_api_key
        assert open_router.router.service.cache_salt(None, "anything") is None
    with RouterInProcess(demo_model_dir, api_keys=KEYS, cache_salt_by_api_key=False) as shared:
        assert shared.router.service.cache_salt(None, "key-a") is None  # asked for: shared


def test_the_cli_salts_by_key_unless_told_not_to() -> None:
    from kvrelay.cli import build_parser, router_settings_from_args

    def settings(*argv: str):
        return router_settings_from_args(build_parser().parse_args(["router", "--model", "m",
                                                                    *argv]))
    assert settings().cache_salt_by_api_key is None  # on exactly when keys are set
    assert settings("--cache-salt-by-api-key").cache_salt_by_api_key is True
    assert settings("--no-cache-salt-by-api-key").cache_salt_by_api_key is False


# -- the client's traceparent ---------------------------------------------------------------------
TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture()
def tracing_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.common import tracing
    monkeypatch.setattr(tracing, "_tracer", object())  # on, as far as parsing is concerned


def test_a_valid_traceparent_is_continued_under_the_routers_own_sampling(tracing_on) -> None:
    """The client's trace and span ids are kept (W3C propagation); its flags are not: a client
    cannot turn the router's (and so the workers') recording of its request off."""
    from kvrelay.router.trace import client_parent
    for flags in ("01", "00", "ff"):
        parent = client_parent([f"00-{TRACE_ID}-{SPAN_ID}-{flags}"])
        ctx = parent.get_span_context()
        assert (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}") == (TRACE_ID, SPAN_ID)
        assert ctx.trace_flags.sampled and int(ctx.trace_flags) == 1, flags
    assert client_parent([f" 00-{TRACE_ID}-{SPAN_ID}-01\t".encode()]) is not None
    # A later version may carry more fields after its flags.
    assert client_parent([f"01-{TRACE_ID}-{SPAN_ID}-01-what-comes-later"]) is not None


@pytest.mark.parametrize("values", [
    [],
    [f"00-{TRACE_ID.upper()}-{SPAN_ID}-01"],  # W3C ids are lowercase hex
    [f"00-{TRACE_ID}-{SPAN_ID.upper()}-01"],
    [f"ff-{TRACE_ID}-{SPAN_ID}-01"],  # version ff is invalid
    [f"00-{TRACE_ID}-{SPAN_ID}-01-extra"],  # version 00 ends at its flags
    [f"01-{TRACE_ID}-{SPAN_ID}-01extra"],
    [f"00-{'0' * 32}-{SPAN_ID}-01"], [f"00-{TRACE_ID}-{'0' * 16}-01"],
    [f"00-{TRACE_ID}-{SPAN_ID}-1"], [f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01"],
    [f"00-{TRACE_ID}-{SPAN_ID}-01\n"], ["00-" + "a" * 10_000],
    [f"00-{TRACE_ID}-{SPAN_ID}-01", f"00-{TRACE_ID}-{SPAN_ID}-01"],  # duplicates: ignored
    ["junk"], [""],
])
def test_a_malformed_traceparent_starts_a_trace_of_the_routers_own(tracing_on, values) -> None:
    from kvrelay.router.trace import client_parent
    assert client_parent(values) is None


def test_without_tracing_no_traceparent_is_read() -> None:
    from kvrelay.router.trace import client_parent
    assert client_parent([f"00-{TRACE_ID}-{SPAN_ID}-01"]) is None
