"""Structured output in the engine: every output a grammar constrains matches it (JSON schema,
JSON object, regex, choice), a resumed request continues its grammar where it left off, bad
specs are refused with their reason, and compiled grammars are cached."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.grammar_mask import MaskFiller, StepMasks, apply_masks
from kvrelay.engine.llm import LLM
from kvrelay.engine.outputs import FinishReason
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.structured import GrammarCompiler, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "n", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = [f"Record {i}: the weather today is" for i in range(12)]
# The longest output SCHEMA admits is 55 characters: even one token per character ends in time.
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def llm(demo_model_dir: str) -> LLM:
    return LLM(demo_model_dir, num_blocks=256, seed=0)


def _prefix_ok(llm: LLM, so: StructuredOutput, token_ids: list[int]) -> bool:
    """A fresh matcher takes every token (the output is a prefix of the grammar's language)."""
    llm.engine.grammar.matcher(so, token_ids)
    return True


def test_json_schema_outputs_validate(llm: LLM) -> None:
    so = StructuredOutput.json_schema(SCHEMA)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                                 structured=so) for i in range(len(PROMPTS))])
    for o in outs:
        assert o.finish_reason == FinishReason.STOP, o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.token_ids[-1] in llm.engine.eos_token_ids  # ended on EOS, allowed only then
    assert len({o.text for o in outs}) > 1  # sampled, not one fixed string


def test_greedy_and_ignore_eos_still_end_when_the_grammar_does(llm: LLM) -> None:
    so = StructuredOutput.json_schema(SCHEMA)
    o = llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                ignore_eos=True, structured=so))[0]
    assert o.finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(o.text), SCHEMA)


def test_regex_and_choice(llm: LLM) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    regex = StructuredOutput("regex", pattern)
    choices = ("yes", "no", "maybe so", 'say "hi"')
    choice = StructuredOutput("choice", choices=choices)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=i, structured=so)
              for so in (regex, choice) for i in range(8)]
    outs = llm.generate([PROMPTS[i % 8] for i in range(16)], params)
    for o in outs[:8]:
        assert re.fullmatch(pattern, o.text), o.text
    for o in outs[8:]:
        assert o.text in choices
        assert o.finish_reason == FinishReason.STOP


def test_json_object_output_stays_inside_the_grammar(llm: LLM) -> None:
    so = StructuredOutput("json_object")
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=24, temperature=0.8, seed=1,
                                                    structured=so))
    for o in outs:
        assert o.text.startswith("{")
        assert _prefix_ok(llm, so, o.token_ids)
        if o.finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(o.text), dict)


def test_a_resumed_request_continues_its_grammar(llm: LLM) -> None:
    """What a migration sends: prompt + output so far, ``resumed_output_tokens`` of them. The
    new engine's matcher replays those tokens; the continuation equals the uninterrupted run."""
    so = StructuredOutput.json_schema(SCHEMA)
    sp = SamplingParams(max_tokens=48, temperature=0.0, structured=so)
    prompt = llm.tokenizer.encode(PROMPTS[3])
    full = llm.generate(prompt, sp)[0].token_ids
    for k in (1, 5, len(full) // 2):
        rest = llm.generate(prompt + full[:k], SamplingParams(
            max_tokens=48 - k, temperature=0.0, structured=so, resumed_output_tokens=k))[0]
        assert full[:k] + rest.token_ids == full


def test_bad_specs_are_refused_with_the_reason(llm: LLM) -> None:
    core = llm.engine
    for so, word in [(StructuredOutput("regex", "(abc"), "unclosed group"),
                     (StructuredOutput.json_schema({"type": "nope"}), "nope"),
                     (StructuredOutput.json_schema({"$ref": "#/missing"}), "missing")]:
        with pytest.raises(ValueError, match=word):
            core.add_request("bad", [5, 6, 7], SamplingParams(structured=so))
        assert "bad" not in core.seqs
    with pytest.raises(ValueError, match="JSON"):
        StructuredOutput.json_schema("{not json")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutput("choice", choices=())


def test_resumed_tokens_that_break_the_grammar_are_refused(llm: LLM) -> None:
    so = StructuredOutput("choice", choices=("yes", "no"))
    bad = llm.tokenizer.encode("maybe")
    with pytest.raises(ValueError, match="does not match"):
        llm.engine.add_request("r", [5, 6] + bad, SamplingParams(
            structured=so, resumed_output_tokens=len(bad)))


def test_decode_start_refuses_a_first_token_outside_the_grammar(demo_model_dir: str) -> None:
    core = EngineCore(EngineConfig.from_kwargs(demo_model_dir, num_blocks=64, seed=0),
                      eos_token_ids=frozenset({2}))
    so = StructuredOutput("regex", "[0-9]+")
    core.reserve("d", [5, 6, 7])
    letter = core.grammar.tokenizer.tokenize_str("x")[0]
    with pytest.raises(ValueError, match="does not match"):
        core.start_decode("d", letter, SamplingParams(structured=so))
    digit = core.grammar.tokenizer.tokenize_str("7")[0]
    core.start_decode("d", digit, SamplingParams(structured=so))
    assert core.seqs["d"].grammar is not None and not core.seqs["d"].grammar.is_error


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_worker_compiles_over_the_vocabulary_the_router_sees(hf_model_dir, arch) -> None:
    """Workers compile grammars over ``tokenizer.json`` as the Rust library reads it (loading
    transformers' tokenizer took seconds, on a worker's first structured request); the router
    over transformers' tokenizer, which some classes rebuild (Qwen2's normalizer and
    pre-tokenizer differ). Masks come from each token's bytes and whether it is special: those
    must be equal."""
    import llguidance as llg

    from kvrelay.engine.tokenizer import load_tokenizer, tokenizer_json

    model_dir = hf_model_dir(arch)
    worker = llg.LLTokenizer(tokenizer_json(model_dir), eos_token=[2])
    router = llg.LLTokenizer(load_tokenizer(model_dir).backend_tokenizer.to_str(), eos_token=[2])
    assert worker.vocab_size == router.vocab_size == 4096
    for i in range(worker.vocab_size):
        assert worker.decode_bytes([i]) == router.decode_bytes([i]), i
        assert worker.is_special_token(i) == router.is_special_token(i), i


def test_a_worker_compiles_grammars_without_transformers(demo_model_dir: str) -> None:
    code = ("import sys\n"
            "from kvrelay.engine.structured import GrammarCompiler, StructuredOutput\n"
            f"c = GrammarCompiler.from_checkpoint({demo_model_dir!r}, 4096, [2])\n"
            "c.matcher(StructuredOutput('regex', 'a+'))\n"
            "print('transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False"]


def test_compiled_grammars_are_cached(demo_model_dir: str) -> None:
    from kvrelay.engine.tokenizer import load_tokenizer

    comp = GrammarCompiler.from_hf(load_tokenizer(demo_model_dir), 4096, [2], capacity=2)
    a, b, c = (StructuredOutput("regex", p) for p in ("a+", "b+", "c+"))
    comp.matcher(a)
    comp.matcher(StructuredOutput("regex", "a+"))  # an equal spec: the same entry
    assert (comp.misses, comp.hits) == (1, 1)
    bad = StructuredOutput("regex", "(")
    for _ in range(2):
        with pytest.raises(ValueError):
            comp.check(bad)
    assert comp.misses == 2  # the failure is cached too
    comp.check(b)
    comp.check(c)  # capacity 2: evicts the oldest
    assert not comp.is_cached(a) and comp.is_cached(c)


def test_masks_on_a_thread_equal_masks_inline(llm: LLM) -> None:
    so = StructuredOutput.json_schema(SCHEMA)
    sp = SamplingParams(max_tokens=48, temperature=0.0, structured=so)
    runner = llm.engine.runner
    default = runner.masks
    got = []
    try:
        for overlap in (False, True):
            runner.masks = MaskFiller(runner.arch.vocab_size, overlap=overlap)
            got.append([o.token_ids for o in llm.generate(PROMPTS[:6], sp)])
    finally:
        runner.masks = default
    assert got[0] == got[1]


def test_the_grammar_wins_over_processors_that_mask_all_it_allows(llm: LLM) -> None:
    """allowed_token_ids (or min_tokens' EOS ban) may exclude every token the grammar allows;
    the row then samples from the grammar alone instead of from nothing."""
    so = StructuredOutput("choice", choices=("yes", "no"))
    other = llm.tokenizer.encode(" weather")
    o = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=0,
                                                structured=so, allowed_token_ids=other,
                                                min_tokens=4))[0]
    assert o.text in ("yes", "no")


def test_apply_masks_only_touches_constrained_rows() -> None:
    logits = torch.randn(3, 70)
    bitmask = torch.zeros((1, 3), dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35 only
    out = apply_masks(logits, logits, StepMasks([1], bitmask))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1].argmax().item() == 35 and torch.isinf(out[1]).sum().item() == 69
    seqs = [Sequence("a", [1], SamplingParams())]
    assert MaskFiller(70).start(seqs) is None  # no grammar: nothing to compute


def test_openai_fields_map_to_one_spec() -> None:
    from kvrelay.router.openai_models import CompletionRequest

    def so(**body: object) -> StructuredOutput | None:
        return CompletionRequest(prompt="x", **body).structured_output()

    assert so() is None and so(response_format={"type": "text"}) is None
    assert so(response_format={"type": "json_object"}) == StructuredOutput("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    by_format = so(response_format={"type": "json_schema",
                                    "json_schema": {"name": "n", "schema": schema}})
    assert by_format == so(guided_json=schema) == so(guided_json=json.dumps(schema, indent=2))
    assert so(guided_regex="a+") == StructuredOutput("regex", "a+")
    assert so(guided_choice=["x", "y"]) == StructuredOutput("choice", choices=("x", "y"))
    for body, word in [({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
                       ({"response_format": {"type": "json_schema"}}, "schema"),
                       ({"guided_grammar": "start: 'a'"}, "not supported")]:
        with pytest.raises(ValueError, match=word):
            so(**body)


def test_specs_cross_the_wire_unchanged() -> None:
    from kvrelay.common.convert import sampling_from_proto, sampling_to_proto

    for spec in (StructuredOutput("json_object"), StructuredOutput.json_schema({"type": "null"}),
                 StructuredOutput("regex", "[a-z]+"),
                 StructuredOutput("choice", choices=("é", "b"))):
        sp = SamplingParams(structured=spec)
        assert sampling_from_proto(sampling_to_proto(sp)).structured == spec
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).structured is None
