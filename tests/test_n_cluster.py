"""``n > 1`` through the disaggregated cluster (1 prefill, 2 decode) with the OpenAI SDK: one
prefill, the decode worker forks the choices; each choice equals a single request of its seed
(seed + index), greedy choices are all equal, streaming carries each choice's index, and a
decode worker killed mid-stream leaves every choice's output unchanged. Every KV block comes
back afterwards."""

from __future__ import annotations

import api_fixtures
import pytest
import torch
from hf_models import hf_forward_logits

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


cluster, oai = api_fixtures.cluster, api_fixtures.oai


@pytest.fixture(scope="module")
def baseline(cluster):
    # The API cluster is shared with other modules: one of their last requests may still be
    # returning its blocks when this module starts (a baseline one block short, seen once).
    return cluster.idle_free_blocks()


def test_each_choice_equals_a_single_request_of_its_seed(cluster, oai, baseline) -> None:
    kw = {"model": "demo", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.9,
          "extra_body": {"ignore_eos": True}}
    r = oai.completions.create(n=4, seed=77, logprobs=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [oai.completions.create(seed=77 + i, logprobs=2, **kw) for i in range(4)]
    for c, s in zip(r.choices, singles, strict=True):
        assert c.text == s.choices[0].text
        assert c.logprobs.tokens == s.choices[0].logprobs.tokens
        assert c.logprobs.token_logprobs == pytest.approx(s.choices[0].logprobs.token_logprobs,
                                                          abs=1e-4)
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == 4 * 12
    assert cluster.wait_free_blocks(baseline) == baseline


def test_greedy_choices_are_equal_on_chat(cluster, oai, baseline) -> None:
    kw = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}],
          "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    r = oai.chat.completions.create(n=4, **kw)
    single = oai.chat.completions.create(**kw).choices[0].message.content
    assert [c.message.content for c in r.choices] == [single] * 4
    assert r.usage.completion_tokens == 40
    assert cluster.wait_free_blocks(baseline) == baseline


def test_streamed_choices_carry_their_index(cluster, oai, baseline) -> None:
    kw = {"model": "demo", "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5,
          "n": 3, "extra_body": {"ignore_eos": True}}
    whole = oai.completions.create(**kw)
    texts = ["", "", ""]
    finished = [None, None, None]
    usage = None
    for ev in oai.completions.create(stream=True, stream_options={"include_usage": True},
                                     **kw):
        for c in ev.choices:
            texts[c.index] += c.text
            finished[c.index] = finished[c.index] or c.finish_reason
        usage = ev.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert finished == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 30
    assert cluster.wait_free_blocks(baseline) == baseline


def test_grpc_messages_carry_the_choice_index(cluster, oai) -> None:
    single = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    texts, finished, usage = ["", ""], [0, 0], None
    with cluster.client() as c:
        for msg in c.stream(PROMPT, sampling(6, 0.0, ignore_eos=True, n=2), timeout=120):
            texts[msg.index] += msg.text
            finished[msg.index] += bool(msg.finish_reason)
            if msg.HasField("usage"):
                usage = msg.usage
    assert texts == [single, single] and finished == [1, 1]
    assert usage is not None and usage.completion_tokens == 12


def test_a_client_leaving_mid_stream_returns_every_block(cluster, oai, baseline) -> None:
    events = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=400, n=3,
                                    temperature=1.0, seed=3, stream=True,
                                    extra_body={"ignore_eos": True})
    for chunks, _ in enumerate(events, start=1):
        if chunks >= 6:
            break
    events.close()
    assert cluster.wait_free_blocks(baseline, timeout=30) == baseline


def test_echo_with_logprobs_matches_transformers(oai, hf_ref) -> None:
    r = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                               echo=True, logprobs=2, n=2, extra_body={"ignore_eos": True})
    plain = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                                   logprobs=2, extra_body={"ignore_eos": True})
    ids, ref = hf_ref
    for c in r.choices:
        assert c.text == PROMPT + plain.choices[0].text
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        n = len(ids)
        want = ref[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()
        assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
        assert [len(t) for t in lp.top_logprobs[1:n]] == [2] * (n - 1)
        assert lp.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
        assert len(lp.tokens) == n + 4
    echo_only = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=3,
                                       temperature=0, echo=True)
    assert echo_only.choices[0].text.startswith(PROMPT) and echo_only.choices[0].logprobs is None


@pytest.fixture(scope="module")
def hf_ref(demo_model_dir):
    """The prompt's token ids and transformers' log-softmax over its positions."""
    ids = load_tokenizer(demo_model_dir).encode(PROMPT)
    return ids, hf_forward_logits(demo_model_dir, ids).log_softmax(-1)


def test_choices_survive_a_decode_worker_kill(cluster, oai, baseline, demo_model_dir) -> None:
    n = 200
    ref = LLM(demo_model_dir, num_blocks=256).generate(
        [PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    decodes = cluster.live("decode")
    # The tiny model can finish both choices before this client, on a loaded host, has read
    # its 10th chunk: then no decode worker holds the stream and the kill proves nothing, so
    # the stream runs again (as Cluster.stream_killing_its_decode_worker does), 3 times at most.
    for _ in range(3):
        texts = ["", ""]
        killed = outran = False
        events = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=n,
                                        temperature=0, n=2, stream=True,
                                        extra_body={"ignore_eos": True})
        for chunks, ev in enumerate(events, start=1):
            for c in ev.choices:
                texts[c.index] += c.text
            if not killed and chunks >= 10:
                victim = next((p for p in decodes if cluster.status(p).load.running >= 1),
                              None)
                if victim is None:
                    outran = True
                    break
                cluster.kill(victim)
                killed = True
        events.close()
        if not outran:
            break
    assert killed, "no decode worker held the stream in 3 tries"
    assert texts == [ref.text, ref.text]
    left = cluster.wait_free_blocks(baseline)
    assert left and all(left[k] == baseline[k] for k in left)
