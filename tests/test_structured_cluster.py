"""Structured output through the disaggregated cluster (1 prefill, 2 decode) with the OpenAI SDK:
the prefill worker samples the first token under the grammar, the decode worker replays it and
goes on; JSON-schema output validates for many random prompts, and still after the decode
worker is killed mid-stream (the request resumes elsewhere, its matcher rebuilt by replaying
its tokens); a grammar that does not compile is a 400 (INVALID_ARGUMENT over gRPC)."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import api_fixtures
import grpc
import jsonschema
import openai
import pytest
from polling import wait_for

from kvrelay.client import sampling
from kvrelay.common.convert import structured_to_proto
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured import StructuredOutput

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
# Long enough a stream that the decode worker can be killed in the middle of it.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                          "minItems": 120, "maxItems": 120}},
    "required": ["xs"],
    "additionalProperties": False,
}
WORDS = ["the", "a", "fox", "dog", "sky", "blue", "runs", "over", "under", "quickly", "seven",
         "river", "stone", "light"]


cluster, oai = api_fixtures.cluster, api_fixtures.oai


def test_json_schema_output_validates_for_50_random_prompts(oai) -> None:
    rng = random.Random(7)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 30)))
               for _ in range(50)]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def one(i: int) -> str:
        if i % 2:
            r = oai.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": prompts[i]}],
                max_tokens=40, temperature=1.0, seed=i, response_format=fmt)
            assert r.choices[0].finish_reason == "stop"
            return r.choices[0].message.content
        r = oai.completions.create(model="demo", prompt=prompts[i], max_tokens=40,
                                   temperature=1.0, seed=i,
                                   extra_body={"guided_json": SCHEMA})
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(50)))
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert len(set(texts)) > 5


def test_regex_and_choice_on_both_apis(oai) -> None:
    pattern = r"[0-9]{2}:[0-9]{2} (am|pm)"
    r = oai.completions.create(model="demo", prompt="The time is", max_tokens=12,
                               temperature=1.0, seed=3, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    choices = ["positive", "negative", "neutral"]
    r = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hm"}],
                                    max_tokens=8, temperature=1.0,
                                    extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices
    r = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=16, temperature=0.8, seed=1,
                                    response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    assert text.startswith("{")


def test_json_schema_survives_a_decode_worker_migration(cluster, oai, demo_model_dir) -> None:
    prompt = "Numbers follow: one two three"
    ref = LLM(demo_model_dir, num_blocks=256).generate(prompt, SamplingParams(
        max_tokens=400, temperature=0.0, structured=StructuredOutput.json_schema(LONG_SCHEMA)))[0]
    assert ref.finish_reason.value == "stop"
    decodes = cluster.live("decode")
    free = {p.name: cluster.status(p).load.free_blocks for p in decodes}
    stream = oai.completions.create(model="demo", prompt=prompt, max_tokens=400,
                                    temperature=0.0, stream=True,
                                    extra_body={"guided_json": LONG_SCHEMA,
                                                "return_trace": True})

    def holder():  # the decode worker streaming it, its output already into a second block
        for p in decodes:
            load = cluster.status(p).load
            if load.running >= 1 and free[p.name] - load.free_blocks >= 2:
                return p
        return None

    # Killed by what the worker reports, not after some chunks reached this client: under
    # load the client reads behind the worker, which may have finished by then.
    cluster.kill(wait_for(holder, 60, "a decode worker midway through the stream",
                          every=0.005))
    chunks: list[str] = []
    trace: list[str] = []
    for c in stream:
        chunks.append(c.choices[0].text if c.choices else "")
        extra = c.model_extra or {}
        if extra.get("kvrelay_trace"):
            trace = [e["name"] for e in extra["kvrelay_trace"]]
    assert "migrate" in trace, trace
    text = "".join(chunks)
    jsonschema.validate(json.loads(text), LONG_SCHEMA)
    assert text == ref.text


def test_grammars_that_do_not_compile_are_400s(oai) -> None:
    bad = [({"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "nope"),
           ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}},
            "defs"),
           ({"guided_regex": "(unclosed"}, "regex"),
           ({"guided_choice": []}, "choice"),
           ({"guided_regex": "a+", "guided_choice": ["a"]}, "at most one"),
           ({"guided_grammar": "start: 'a'"}, "guided_grammar"),
           ({"response_format": {"type": "xml"}}, "response_format")]
    for body, word in bad:
        with pytest.raises(openai.BadRequestError, match=word):
            oai.completions.create(model="demo", prompt="Hi", max_tokens=4, extra_body=body)
    with pytest.raises(openai.BadRequestError, match="nope"):
        oai.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nope"}}})


def test_grpc_refuses_a_bad_grammar_with_invalid_argument(cluster) -> None:
    params = sampling(4, 0.0)
    params.structured.CopyFrom(structured_to_proto(StructuredOutput("regex", "[z-a]")))
    with cluster.client() as c, pytest.raises(grpc.RpcError) as e:
        list(c.stream("Hi", params, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "regex" in e.value.details()


def test_each_of_n_choices_follows_the_grammar_on_its_own(oai) -> None:
    """n > 1: the prefill samples every choice's first token under the grammar, and each fork
    on the decode worker carries a matcher of its own."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = oai.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Who?"}],
                                    max_tokens=40, temperature=1.0, seed=5, n=4,
                                    response_format=fmt)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    for c, t in zip(r.choices, texts, strict=True):
        assert c.finish_reason == "stop", t
        jsonschema.validate(json.loads(t), SCHEMA)
    assert len(set(texts)) > 1
