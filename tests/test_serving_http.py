"""The router's public APIs against real processes: gRPC and the OpenAI HTTP API (driven by the
official ``openai`` client), /metrics, and bad input refused while the servers keep serving."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import openai
import pytest
from cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families

import kvrelay
from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "def main():"]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    # The disaggregated path (1P1D over NIXL): what the OpenAI client sees must equal gRPC.
    c = Cluster(demo_model_dir, tmp_path_factory.mktemp("pd"), prefill=1, decode=1,
                router_args=("--http-port", "0", "--served-model-name", "demo"))
    with c:
        yield c


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    llm = LLM(demo_model_dir, num_blocks=256)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return {p: o for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def oai(cluster):
    port = cluster.router.ready["http_port"]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def test_grpc_greedy_equals_the_engine_alone(cluster, reference) -> None:
    with cluster.client() as c:
        for p in PROMPTS:
            r = c.generate(p, sampling(24, 0.0, ignore_eos=True))
            assert r.token_ids == reference[p].token_ids
            assert r.text == reference[p].text
            assert r.finish_reason == "length" and r.usage.completion_tokens == 24
            assert r.timing.ttft_ms > 0 and r.trace[0].name == "received"


def test_openai_completions_match_grpc(cluster, oai, reference) -> None:
    for p in PROMPTS:
        want = reference[p].text
        r = oai.completions.create(model="demo", prompt=p, max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
        assert r.choices[0].logprobs is None  # none asked for
        assert r.usage.completion_tokens == 24
        chunks = list(oai.completions.create(model="demo", prompt=p, max_tokens=24,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == 24


def test_openai_chat_streaming_and_not(cluster, oai, demo_model_dir) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = oai.chat.completions.create(model="demo", messages=msgs, max_tokens=16, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 5
    assert r.choices[0].logprobs is None
    stream = oai.chat.completions.create(model="demo", messages=msgs, max_tokens=16,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text
    # The chat template rendered by the tokenizer, generated offline, gives the same text.
    from kvrelay.engine.tokenizer import apply_chat_template

    llm = LLM(demo_model_dir, num_blocks=64)
    ids = llm.tokenizer.encode(apply_chat_template(llm.tokenizer, msgs),
                               add_special_tokens=False)
    assert llm.generate(ids, SamplingParams(max_tokens=16, temperature=0))[0].text == text


def test_logprobs_stop_and_models(cluster, oai) -> None:
    r = oai.completions.create(model="demo", prompt="Hello", max_tokens=4, temperature=0,
                               logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) == 3 for t in lp.top_logprobs)
    full = oai.completions.create(model="demo", prompt="Hello", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    r = oai.completions.create(model="demo", prompt="Hello", max_tokens=20, temperature=0,
                               stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert full.startswith(r.choices[0].text)
    assert [m.id for m in oai.models.list().data] == ["demo"]


def test_http_errors_are_openai_objects(cluster) -> None:
    base = f"http://127.0.0.1:{cluster.router.ready['http_port']}"
    cases = [
        {"model": "demo", "prompt": "x", "max_tokens": 0},
        {"model": "demo", "prompt": "x", "temperature": -1},
        {"model": "demo", "prompt": "x", "n": 17},
        {"model": "demo", "prompt": ""},
        {"model": "demo", "prompt": [999999]},
        {"model": "demo", "prompt": "x" * 20000},
        {"prompt": 5},
    ]
    for body in cases:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
    assert r.status_code == 404
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_metrics_parse_and_move(cluster, oai) -> None:
    base = f"http://127.0.0.1:{cluster.router.ready['http_port']}"

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("" if not s.labels.get("finished_reason")
                                else f"[{s.labels['finished_reason']}]")
                out[key] = out.get(key, 0.0) + s.value
        return out

    before = scrape()
    r = oai.completions.create(model="demo", prompt="Count: 1 2 3 4 5 6 7 8 9 10 11 12 13 14",
                               max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True, "return_trace": True})
    after = scrape()
    # The per-request trace names each phase and the worker that ran it.
    trace = r.model_extra["kvrelay_trace"]
    names = [e["name"] for e in trace]
    assert names[:4] == ["received", "reserved", "prefill_start", "prefill_end"]
    assert "decode_start" in names and names[-1] == "finished"
    [prefiller] = {e["worker"] for e in trace if e["name"] == "prefill_end"}
    assert prefiller.startswith("prefill")
    assert after["kvrelay:kv_transfer_bytes_total"] > before.get("kvrelay:kv_transfer_bytes_total",
                                                                 0)
    assert after["kvrelay:kv_transfer_time_seconds_count"] > \
        before.get("kvrelay:kv_transfer_time_seconds_count", 0)
    assert after["kvrelay:request_success_total[length]"] == \
        before.get("kvrelay:request_success_total[length]", 0) + 1
    assert after["kvrelay:generation_tokens_total"] >= \
        before.get("kvrelay:generation_tokens_total", 0) + 8
    assert after["kvrelay:time_to_first_token_seconds_count"] > \
        before.get("kvrelay:time_to_first_token_seconds_count", 0)
    assert after["kvrelay:workers"] >= 1 and "kvrelay:kv_cache_usage_perc" in after


def test_grpc_bad_input_then_still_serving(cluster) -> None:
    import grpc

    with cluster.client() as c:
        bad = [("", sampling(4)), ("hi", sampling(4, temperature=-1.0)),
               ([10**7], sampling(4)), ("hi", sampling(0)), ("x" * 20000, sampling(4)),
               ("hi", sampling(4, top_p=0.0))]
        for prompt, sp in bad:
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, sp)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (prompt, sp)
            assert e.value.details()
        assert c.generate("still alive?", sampling(4)).usage.completion_tokens >= 1


def test_non_streaming_request_stops_when_its_client_leaves(cluster) -> None:
    base = f"http://127.0.0.1:{cluster.router.ready['http_port']}"
    decode = cluster.proc("decode-1")

    def lengths() -> float:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "kvrelay:request_success_total"
                   and s.labels.get("finished_reason") == "length")

    baseline = cluster.free_blocks()
    # An earlier test's last request may be counted a moment after its client had the answer.
    finished, deadline = lengths(), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if (now := lengths()) == finished:
            break
        finished = now
    # Far more tokens than the client waits for: it gives up after a second of silence.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", timeout=httpx.Timeout(30, read=1.0),
                   json={"model": "demo", "prompt": "Tell me everything", "max_tokens": 4000,
                         "ignore_eos": True})
    # The decode worker stops generating, its blocks come back, and the request never
    # finished (it was aborted, not run to its length).
    deadline = time.monotonic() + 30
    while cluster.status(decode).load.running:
        assert time.monotonic() < deadline, "the request kept generating"
        time.sleep(0.1)
    assert cluster.wait_free_blocks(baseline) == baseline
    assert lengths() == finished


def test_cache_salt_isolates_prefix_cache_sharing(cluster, oai) -> None:
    """A prompt cached under one salt is not a hit under another (nor without one), and is
    under the same salt; a salt over 256 characters is a 400."""
    prompt = "Tenant isolation: " + " ".join(f"word{i}" for i in range(60))

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        r = oai.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0,
                                   extra_body=extra)
        details = r.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    cached("alice")
    assert cached("alice") > 0
    assert cached("bob") == 0
    assert cached("bob") > 0
    with pytest.raises(openai.BadRequestError):
        cached("x" * 257)


def test_cache_salt_by_api_key_keys_the_namespace() -> None:
    from kvrelay.router.service import RouterService

    svc = RouterService.__new__(RouterService)
    svc.cache_salt_by_api_key = False
    assert svc.cache_salt("s", "key-1") == "s" and svc.cache_salt(None, "key-1") is None
    svc.cache_salt_by_api_key = True
    one, two = svc.cache_salt(None, "key-1"), svc.cache_salt(None, "key-2")
    assert one and two and one != two and "key-1" not in one  # the key itself never travels
    assert svc.cache_salt(None, "key-1") == one  # stable: a tenant still shares with itself
    assert svc.cache_salt("s", "key-1") not in (one, svc.cache_salt("s", "key-2"))
    assert svc.cache_salt("s", None) == "s"  # no key presented: the request's own salt


def test_tokenize_detokenize_version(cluster, oai, demo_model_dir) -> None:
    """vLLM's shapes: /tokenize counts what a prompt (or chat messages, rendered with the chat
    endpoint's template) costs, /detokenize turns ids back into text, /version answers."""
    port = cluster.router.ready["http_port"]
    tok = load_tokenizer(demo_model_dir)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        r = c.post("/tokenize", json={"model": "demo", "prompt": "The quick brown fox"}).json()
        assert r["tokens"] == tok.encode("The quick brown fox") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] > 0
        msgs = [{"role": "user", "content": "Hi there"}]
        chat = c.post("/tokenize", json={"messages": msgs}).json()
        usage = oai.chat.completions.create(model="demo", messages=msgs, max_tokens=1).usage
        assert chat["count"] == usage.prompt_tokens  # the chat endpoint's own rendering
        back = c.post("/detokenize", json={"tokens": r["tokens"]}).json()
        assert back["prompt"] == tok.decode(r["tokens"])
        assert c.get("/version").json() == {"version": kvrelay.__version__}
        for path, body in (("/tokenize", {"prompt": "x", "messages": msgs}),
                           ("/tokenize", {}), ("/detokenize", {"tokens": [10**9]}),
                           ("/detokenize", {"tokens": "nope"})):
            bad = c.post(path, json=body)
            assert bad.status_code == 400 and bad.json()["error"]["message"], (path, body)
        assert c.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_chat_template_flag_serves_a_checkpoint_without_one(demo_model_dir, tmp_path) -> None:
    """A checkpoint whose tokenizer has no chat template: chat is a 400 naming the flag, and
    with --chat-template the router renders the conversation with the given one."""
    model = tmp_path / "no-template"
    shutil.copytree(demo_model_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    tmpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    msgs = [{"role": "user", "content": "Hi there"}]
    tok = load_tokenizer(str(model))
    for args, want in (((), None), (("--chat-template", tmpl), "<user>Hi there<assistant>")):
        with Cluster(str(model), tmp_path / f"r{len(args)}", prefill=0, decode=0,
                     router_args=("--http-port", "0", *args)) as c:
            port = c.router.ready["http_port"]
            r = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"messages": msgs},
                           timeout=30)
            if want is None:
                assert r.status_code == 400 and "--chat-template" in r.text
            else:
                assert r.json()["tokens"] == tok.encode(want, add_special_tokens=False)
