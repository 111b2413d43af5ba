"""Penalties, logit_bias, bad words and logprobs through the disaggregated cluster (1 prefill,
2 decode): the OpenAI SDK's requests give the engine-alone reference's tokens, and a request with
penalties and bad words whose decode worker is killed mid-stream resumes on the other with
identical output."""

from __future__ import annotations

import api_fixtures
import openai
import pytest

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import bad_words_token_ids, load_tokenizer
from kvrelay.proto import generate_pb2 as pb

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
PENALTIES = {"presence_penalty": 1.2, "frequency_penalty": 0.7, "repetition_penalty": 1.6}


cluster, oai = api_fixtures.cluster, api_fixtures.oai


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, num_blocks=512)


def test_penalties_and_logit_bias_give_the_reference_tokens(oai, llm) -> None:
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0,
                                                  ignore_eos=True))[0]
    banned = plain.token_ids[0]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **PENALTIES,
                        logit_bias={banned: -100.0})
    ref = llm.generate([PROMPT], sp)[0]
    assert ref.token_ids != plain.token_ids and banned not in ref.token_ids
    r = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0,
                               presence_penalty=1.2, frequency_penalty=0.7,
                               logit_bias={str(banned): -100},
                               extra_body={"ignore_eos": True, "repetition_penalty": 1.6})
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_bad_words_give_the_reference_tokens(oai, llm, demo_model_dir) -> None:
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0,
                                                  ignore_eos=True))[0]
    word = next(w for w in plain.text.split() if len(w) > 2)
    ids = bad_words_token_ids(load_tokenizer(demo_model_dir), [word])
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                bad_words_token_ids=ids))[0]
    assert ref.token_ids != plain.token_ids, "the ban changed nothing: a vacuous test"
    for w in ids:
        assert not any(tuple(ref.token_ids[i:i + len(w)]) == w for i in range(len(ref.token_ids)))
    r = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0,
                               extra_body={"ignore_eos": True, "bad_words": [word]})
    assert r.choices[0].text == ref.text
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        oai.completions.create(model="demo", prompt=PROMPT, max_tokens=4,
                               extra_body={"bad_words": ["   "]})


def test_bad_values_are_400s_with_a_message(oai) -> None:
    for extra, word in [({"presence_penalty": 3}, "presence_penalty"),
                        ({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"logit_bias": {"99999999": 1}}, "vocabulary"),
                        ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens")]:
        body = {"max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError, match=word):
            oai.completions.create(model="demo", prompt=PROMPT, extra_body=body)


def test_chat_top_logprobs(oai) -> None:
    r = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                    frequency_penalty=0.5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0.0


def test_penalties_bias_and_bad_words_survive_a_decode_worker_migration(cluster, llm) -> None:
    n = 300
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **PENALTIES)
    free = llm.generate([PROMPT], sp)[0].token_ids
    # A pair the penalized output holds well after the kill point: only the resumed worker
    # can ban it, from the output it was handed.
    bad = (free[150], free[151])
    bias = {free[200]: -100.0, free[3]: 2.5}
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **PENALTIES,
                        bad_words_token_ids=[bad], logit_bias=bias)
    ref = llm.generate([PROMPT], sp)[0]
    assert ref.token_ids != free
    decodes = cluster.live("decode")
    got: list[int] = []
    trace: list[str] = []
    killed = False
    with cluster.client() as c:
        params = sampling(n, 0.0, ignore_eos=True, **PENALTIES,
                          bad_words=[pb.TokenIds(ids=bad)], logit_bias=bias)
        for msg in c.stream(PROMPT, params, timeout=180):
            got.extend(msg.token_ids)
            if not killed and len(got) >= 8:
                victim = next((p for p in decodes if cluster.status(p).load.running >= 1), None)
                assert victim is not None, "no decode worker holds the stream"
                cluster.kill(victim)
                killed = True
            if msg.finish_reason:
                trace = [e.name for e in msg.trace]
    assert killed and "migrate" in trace, trace
    assert len(got) == n
    assert got == ref.token_ids
    assert not any(tuple(got[i:i + 2]) == bad for i in range(n - 1))
