"""Security and overload behaviour of a real cluster (1P2D, every protection on at once).

- API keys on the public gRPC and HTTP APIs, read from a file and from the environment: a missing
  or wrong key is refused (UNAUTHENTICATED / 401), either right key is served; health is exempt.
- The cluster token on internal ports: calls without it or with a wrong one (what a rogue router
  would make) are refused, and a worker with a wrong token never joins.
- TLS on gRPC and HTTP, with a CA and a server certificate made here: plaintext clients fail,
  clients that trust the CA are served.
- No secret (API key, cluster token, wrong ones included) in any process's log, at DEBUG level.
- Bounded admission: beyond --max-inflight (with no queue for a slot: --max-queued 0) the router
  answers RESOURCE_EXHAUSTED with ``retry-after-ms`` trailing metadata / HTTP 429 with
  ``Retry-After``; admitted requests finish. (The fair queue itself: test_fair_queue.)
- SIGTERM drains a decode worker: its streams in flight finish there, new requests go to the
  other decode worker, and the process exits 0.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import signal
import ssl
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from cluster import Cluster

from kvrelay.client import Client, sampling
from kvrelay.common.rpc import CLUSTER_TOKEN_KEY
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc, worker_pb2_grpc
from kvrelay.proto import worker_pb2 as wpb

pytestmark = pytest.mark.slow

MODEL = "demo"
DRAIN_S = 45.0  # the workers' --drain-timeout
MAX_INFLIGHT = 4
HELD = 1000  # tokens each of the streams holding every slot generates
ENV_KEY = "sk-env-" + secrets.token_hex(12)
FILE_KEY = "sk-file-" + secrets.token_hex(12)
WRONG_KEY = "sk-wrong-" + secrets.token_hex(12)
TOKEN = "ct-" + secrets.token_hex(16)
WRONG_TOKEN = "ct-wrong-" + secrets.token_hex(16)
SECRETS = (ENV_KEY, FILE_KEY, WRONG_KEY, TOKEN, WRONG_TOKEN)


# -- certificates ---------------------------------------------------------------------------------
def make_certs(out: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signed for 127.0.0.1 / localhost: (ca, cert, key)."""
    ca, cert, key = out / "ca.pem", out / "server.pem", out / "server.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        _make_certs_openssl(out, ca, cert, key)
        return ca, cert, key
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrelay test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
                .issuer_name(ca_name).public_key(srv_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                    critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert.write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(srv_key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return ca, cert, key


def _make_certs_openssl(out: Path, ca: Path, cert: Path, key: Path) -> None:
    ca_key, csr, ext = out / "ca.key", out / "server.csr", out / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(ca_key), "-out", str(ca), "-days", "1", "-subj", "/CN=kvrelay test CA")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
        str(key), "-out", str(csr), "-subj", "/CN=localhost")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))


# -- the cluster ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory, tls):
    work = tmp_path_factory.mktemp("secure")
    key_file = work / "api-keys.txt"
    key_file.write_text(f"# one key a line\n{FILE_KEY}\n\n")
    _, cert, key = tls
    # Heartbeats every 0.5 s (the harness's 0.3 s drops a worker after 0.9 s silent): under a
    # full `make test` the DEBUG-logging workers and router of the admission test's four long
    # streams once went ~1 s between beats on a starved host, and the router dropped both decode
    # workers twice over, failing the streams it was to keep.
    c = Cluster(demo_model_dir, work, prefill=1, decode=2, cluster_token=TOKEN, heartbeat_s=0.5,
                worker_args=("--drain-timeout", str(DRAIN_S)),
                env={"KVRELAY_API_KEYS": ENV_KEY, "KVRELAY_LOG_LEVEL": "DEBUG"},
                router_args=("--http-port", "0", "--served-model-name", MODEL,
                             "--api-key-file", str(key_file), "--tls-cert", str(cert),
                             "--tls-key", str(key), "--max-inflight", str(MAX_INFLIGHT),
                             "--max-queued", "0"))
    with c:
        yield c


@pytest.fixture(scope="module")
def ca(tls) -> str:
    return str(tls[0])


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return f"https://127.0.0.1:{cluster.router.ready['http_port']}"


@pytest.fixture(scope="module")
def https(ca) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


def client(cluster: Cluster, ca: str, key: str | None = ENV_KEY) -> Client:
    return Client(cluster.address, api_key=key, tls_ca=ca)


def _code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return None


# -- API keys -------------------------------------------------------------------------------------
def test_grpc_api_keys_from_env_and_file(cluster, ca) -> None:
    for key in (None, WRONG_KEY, "", ENV_KEY.upper()):
        with client(cluster, ca, key) as c:
            assert _code(lambda c=c: c.generate("hi", sampling(2))) == \
                grpc.StatusCode.UNAUTHENTICATED, key
            assert _code(lambda c=c: c.stub.ListModels(pb.ListModelsRequest(),
                                                       metadata=c.metadata, timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
    for key in (ENV_KEY, FILE_KEY):
        with client(cluster, ca, key) as c:
            assert c.generate("hi", sampling(3, ignore_eos=True)).usage.completion_tokens == 3
    with client(cluster, ca, None) as c:  # the x-api-key form
        got = c.stub.ListModels(pb.ListModelsRequest(), metadata=(("x-api-key", FILE_KEY),),
                                timeout=10)
        assert [m.id for m in got.models] == [MODEL]
        # health stays open (probes carry no key)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        h = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=10)
        assert h.status == health_pb2.HealthCheckResponse.SERVING


def test_http_api_keys(cluster, base_url, https) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=base_url, verify=https, timeout=30) as h:
        for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"x-api-key": "nope"},
                        {"Authorization": ENV_KEY}):
            r = h.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
            assert h.get("/v1/models", headers=headers).status_code == 401
        for headers in ({"Authorization": f"Bearer {ENV_KEY}"}, {"x-api-key": FILE_KEY}):
            r = h.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
        assert h.get("/health").status_code == 200  # probes carry no key


# -- TLS ------------------------------------------------------------------------------------------
def test_tls_on_grpc_and_http(cluster, ca, base_url, https) -> None:
    # A plaintext gRPC client cannot talk to the TLS port.
    with grpc.insecure_channel(cluster.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        assert _code(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=5,
                                             metadata=(("x-api-key", ENV_KEY),))) == \
            grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the CA refuses the server.
    with grpc.secure_channel(cluster.address, grpc.ssl_channel_credentials()) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        assert _code(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=5,
                                             metadata=(("x-api-key", ENV_KEY),))) == \
            grpc.StatusCode.UNAVAILABLE
    with client(cluster, ca) as c:
        assert c.generate("over TLS", sampling(2)).usage.completion_tokens >= 1
    # HTTP: https with the CA works; plain http and an untrusting client fail.
    auth = {"Authorization": f"Bearer {ENV_KEY}"}
    with httpx.Client(verify=https, timeout=30) as h:
        assert h.get(f"{base_url}/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
    with pytest.raises(httpx.HTTPError):
        httpx.get(base_url.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(httpx.HTTPError):  # the default trust store does not know our CA
        httpx.get(f"{base_url}/health", timeout=10)


# -- cluster token --------------------------------------------------------------------------------
def test_internal_ports_need_the_cluster_token(cluster) -> None:
    decode, prefill = cluster.proc("decode-1"), cluster.proc("prefill-1")
    for md in ((), ((CLUSTER_TOKEN_KEY, WRONG_TOKEN),), ((CLUSTER_TOKEN_KEY, ""),)):
        # What a router (or anyone) without the right token gets from the workers ...
        with grpc.insecure_channel(decode.address) as ch:
            d = worker_pb2_grpc.DecodeWorkerStub(ch)
            ctl = worker_pb2_grpc.WorkerControlStub(ch)
            assert _code(lambda d=d, md=md: d.Reserve(wpb.ReserveRequest(
                request_id="x", prompt_token_ids=[1, 2, 3]), metadata=md, timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda d=d, md=md: list(d.Decode(wpb.DecodeRequest(
                request_id="x", lease_id="y"), metadata=md, timeout=10))) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda c=ctl, md=md: c.GetStatus(wpb.GetStatusRequest(), metadata=md,
                                                          timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda c=ctl, md=md: c.Drain(wpb.DrainRequest(), metadata=md,
                                                      timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(prefill.address) as ch:
            p = worker_pb2_grpc.PrefillWorkerStub(ch)
            assert _code(lambda p=p, md=md: p.Prefill(wpb.PrefillRequest(request_id="x"),
                                                      metadata=md, timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
        # ... and from the router's control port (a worker without the token).
        with grpc.insecure_channel(cluster.control_address) as ch:
            r = worker_pb2_grpc.RegistryStub(ch)
            assert _code(lambda r=r, md=md: r.ListWorkers(wpb.ListWorkersRequest(),
                                                          metadata=md, timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda r=r, md=md: r.Heartbeat(wpb.HeartbeatRequest(), metadata=md,
                                                        timeout=10)) == \
                grpc.StatusCode.UNAUTHENTICATED
    # The right token is served (and nothing above drained the worker).
    assert not cluster.status(decode).load.draining
    assert {w.info.worker_id for w in cluster.registered()} >= {"decode-1", "prefill-1"}


def test_worker_with_a_wrong_token_never_joins(cluster) -> None:
    rogue = cluster.add_worker("decode", worker_id="rogue-decode", wait=False,
                               env={"KVRELAY_CLUSTER_TOKEN": WRONG_TOKEN})
    try:
        cluster.wait_ready(rogue)
        # Until five of its beats were refused (each one logged: the cluster logs at DEBUG),
        # it is never listed; one accepted beat would have listed it.
        deadline = time.monotonic() + 30
        while rogue.log.read_text().count("failed (UNAUTHENTICATED)") < 5:
            assert time.monotonic() < deadline, rogue.tail()
            assert "rogue-decode" not in {w.info.worker_id for w in cluster.registered()}
            time.sleep(0.1)
        assert "rogue-decode" not in {w.info.worker_id for w in cluster.registered()}
    finally:
        cluster.kill(rogue)
        cluster.workers.remove(rogue)


# -- overload -------------------------------------------------------------------------------------
def test_bounded_admission_refuses_with_a_retry_hint(cluster, ca, base_url, https) -> None:
    # MAX_INFLIGHT long streams hold every slot, half of them each key's (its share: with two
    # keys one alone leaves a slot for the other); each has produced a token. Long enough to
    # outlast the refusals below: the tiny model decoded 250 tokens a stream before the third
    # refusal once (a slot came free, and the request was rightly admitted).
    holders = [client(cluster, ca, FILE_KEY if k % 2 else ENV_KEY) for k in range(MAX_INFLIGHT)]
    streams = [c.stream(list(range(10 + k, 60 + k)), sampling(HELD, 0.0, ignore_eos=True),
                        timeout=120) for k, c in enumerate(holders)]
    firsts = [next(s) for s in streams]
    assert all(m.token_ids for m in firsts)
    try:
        with client(cluster, ca) as c:
            for _ in range(3):
                call = c.stream("one too many", sampling(4))
                with pytest.raises(grpc.RpcError) as e:
                    list(call)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                hint = dict(e.value.trailing_metadata() or ())
                assert int(hint["retry-after-ms"]) > 0, hint
        with httpx.Client(base_url=base_url, verify=https, timeout=30) as h:
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {FILE_KEY}"})
            assert r.status_code == 429, r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        # The admitted requests all finish, in full.
        for first, s in zip(firsts, streams, strict=True):
            msgs = [first, *s]
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(m.token_ids) for m in msgs) == HELD
    finally:
        for s in streams:
            s.cancel()
        for c in holders:
            c.close()
    with client(cluster, ca) as c:  # room again
        assert c.generate("after the burst", sampling(2)).usage.completion_tokens >= 1


# -- SIGTERM drain --------------------------------------------------------------------------------
def test_sigterm_drains_a_decode_worker(cluster, ca) -> None:
    decoders = [cluster.proc("decode-1"), cluster.proc("decode-2")]
    results: dict[int, object] = {}
    # The previous test's streams, cancelled, are gone from the workers (and their slots).
    deadline = time.monotonic() + 60
    while any(cluster.status(p).load.running for p in decoders):
        assert time.monotonic() < deadline, "streams of an earlier test still running"
        time.sleep(0.05)

    def stream(k: int) -> None:
        with client(cluster, ca) as c:
            for _ in range(50):  # the previous test's streams may still be letting go
                try:
                    results[k] = c.generate(list(range(100 + k, 180 + k)),
                                            sampling(300, 0.0, ignore_eos=True), timeout=120)
                except grpc.RpcError as e:
                    results[k] = e
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        time.sleep(0.1)
                        continue
                return

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(MAX_INFLIGHT - 1)]
    for t in threads:
        t.start()
    # The victim: a decode worker with a stream in flight (whichever the policy chose).
    deadline = time.monotonic() + 60
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, "no stream reached a decode worker"
        victim = next((p for p in decoders if cluster.status(p).load.running >= 1), None)
        time.sleep(0.01)
    other = next(p for p in decoders if p is not victim)
    cluster.kill(victim, signal.SIGTERM)
    # Its beats told the router how long it may take to drain (the grace of its calls).
    assert {w.info.drain_timeout_s for w in cluster.registered()} == {DRAIN_S}
    # Once it has announced the drain, new requests go to the other decode worker.
    while not any(w.load.draining for w in cluster.registered()
                  if w.info.worker_id == victim.name):
        assert time.monotonic() < deadline, "the router never saw the victim draining"
        time.sleep(0.01)
    # (Of the other key: the streams' key holds all but the slot kept for another key.)
    with client(cluster, ca, FILE_KEY) as c:
        while victim.popen.poll() is None and time.monotonic() < deadline:
            r = c.generate([5, 6, 7, 8], sampling(3, 0.0, ignore_eos=True), timeout=60)
            assert r.usage.completion_tokens == 3
            used = {e.worker for e in r.trace if e.name == "reserved"}
            assert used == {other.name}, [(e.name, e.worker) for e in r.trace]
    for t in threads:
        t.join(120)
    assert cluster.wait_exit(victim, 60) == 0, victim.tail()
    # Its last beat took it out of the router's list (not missed beats after it exited).
    log = cluster.router.log.read_text()
    assert f"worker {victim.name} left" in log and "drained and silent" not in log
    # Every stream in flight finished, those on the victim there (no migration).
    on_victim = 0
    for k, r in results.items():
        assert not isinstance(r, Exception), (k, r)
        assert r.finish_reason == "length" and len(r.token_ids) == 300
        names = [e.name for e in r.trace]
        assert "migrate" not in names, names
        on_victim += any(e.worker == victim.name for e in r.trace if e.name == "reserved")
    assert on_victim >= 1


# -- logs -----------------------------------------------------------------------------------------
def test_no_secret_in_any_log(cluster) -> None:
    logs = sorted(cluster.workdir.glob("*.log"))
    assert len(logs) >= 4
    assert " DEBUG " in cluster.router.log.read_text()  # the most verbose level was on
    for log in logs:
        text = log.read_text(errors="replace")
        for s in SECRETS:
            assert s not in text, f"{log.name} holds a secret"
