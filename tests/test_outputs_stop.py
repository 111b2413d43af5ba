"""Stop handling of the router's ``ChoiceOutputs`` when a worker's chunk carries several tokens
(its engine merges the outputs of steps its stream has not sent yet): a stop string that
completes mid-chunk ends the output at that token (token ids, logprobs and usage included, as
vLLM's), EOS / stop token ids and max_tokens keep the chunk whole, the output never depends on
how the tokens were chunked, and coalescing the deltas keeps their finish."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvrelay.engine.outputs import FinishReason, TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import load_tokenizer
from kvrelay.router.coalesce import merge
from kvrelay.router.outputs import ChoiceOutputs, Delta
from kvrelay.router.requests import GenerateSpec, TokenChunk
from kvrelay.router.trace import Trace

TEXT = "The answer is 42. STOP HERE, and then the model went on talking for a while."
PROMPT = [1, 40, 41]


@pytest.fixture(scope="module")
def tok(demo_model_dir: str) -> Any:
    return load_tokenizer(demo_model_dir)


def _lp(t: int) -> TokenLogprob:
    return TokenLogprob(t, -0.25, [(t, -0.25)])


def _outputs(tok: Any, **sampling: Any) -> ChoiceOutputs:
    spec = GenerateSpec("r", list(PROMPT), SamplingParams(**sampling))
    return ChoiceOutputs(spec, tok, Trace())


def _chunk(ids: list[int], finish: FinishReason | None = None, index: int = 0) -> TokenChunk:
    return TokenChunk(list(ids), [_lp(t) for t in ids], finish, index=index)


def _run(tok: Any, chunks: list[TokenChunk], **sampling: Any) -> list[Delta]:
    outs = _outputs(tok, **sampling)
    return [d for c in chunks if (d := outs.add(c)) is not None]


def _summary(deltas: list[Delta]) -> tuple[Any, ...]:
    last = deltas[-1]
    assert last.finished and last.done and last.usage is not None
    assert not any(d.finished for d in deltas[:-1])
    return ("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
            [lp for d in deltas for lp in d.logprobs], last.finish_reason, last.stop_reason,
            last.usage.completion_tokens)


def _split(ids: list[int], rng: random.Random) -> list[list[int]]:
    parts, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 6)
        parts.append(ids[i:i + k])
        i += k
    return parts


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_mid_chunk_ends_output_at_its_token(tok: Any, include: bool) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    sampling = dict(stop=["STOP HERE", "never"], include_stop_str_in_output=include,
                    max_tokens=len(ids))
    # One token a chunk: the stop string completes on token k.
    single = _run(tok, [_chunk([t]) for t in ids], **sampling)
    k = len(single)
    assert 5 < k < len(ids) - 5
    # The whole output in one chunk (the worker's last: max_tokens), the stop mid-way.
    (d,) = _run(tok, [_chunk(ids, FinishReason.LENGTH)], **sampling)
    assert d.text == ("The answer is 42. STOP HERE" if include else "The answer is 42. ")
    assert d.token_ids == ids[:k]
    assert d.logprobs == [_lp(t) for t in ids[:k]]
    assert (d.finished, d.done) == (True, True)
    assert (d.finish_reason, d.stop_reason) == (FinishReason.STOP, "STOP HERE")
    assert d.usage is not None and d.usage.completion_tokens == k
    assert d.usage.prompt_tokens == len(PROMPT)
    assert _summary([d]) == _summary(single)
    # Mid-stream: the chunk that completes the stop ends the choice; later chunks are dropped.
    outs = _outputs(tok, **sampling)
    first = outs.add(_chunk(ids[:3]))
    assert first is not None and not first.finished
    last = outs.add(_chunk(ids[3:k + 4]))
    assert last is not None and last.done and last.token_ids == ids[3:k]
    assert outs.n_out == k
    assert outs.add(_chunk(ids[k + 4:], FinishReason.LENGTH)) is None
    assert outs.n_out == k


def test_output_does_not_depend_on_chunking(tok: Any) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    eos = tok.eos_token_id
    rng = random.Random(7)
    cases: list[tuple[list[int], FinishReason, dict[str, Any]]] = [
        (ids, FinishReason.LENGTH, dict(stop=["STOP HERE"])),
        (ids, FinishReason.LENGTH, dict(stop=["STOP HERE"], include_stop_str_in_output=True)),
        (ids, FinishReason.LENGTH, dict(stop=[" went", "42. S"])),
        (ids, FinishReason.LENGTH, dict(stop=["e"])),
        (ids + [eos], FinishReason.STOP, dict(stop=["not in the text"])),
        (ids + [eos], FinishReason.STOP, dict(stop=["a while."])),  # on the token before EOS
        (ids + [eos], FinishReason.STOP, dict(stop=["a while."], skip_special_tokens=False,
                                              include_stop_str_in_output=True)),
        (ids, FinishReason.LENGTH, dict()),
    ]
    for out_ids, finish, sampling in cases:
        sampling["max_tokens"] = len(out_ids)
        ref = _summary(_run(tok, [_chunk([t]) for t in out_ids[:-1]]
                            + [_chunk(out_ids[-1:], finish)], **sampling))
        for _ in range(20):
            parts = _split(out_ids, rng)
            chunks = [_chunk(p) for p in parts[:-1]] + [_chunk(parts[-1], finish)]
            assert _summary(_run(tok, chunks, **sampling)) == ref, (sampling, parts)


def test_stop_token_and_max_tokens_keep_the_chunk(tok: Any) -> None:
    ids = tok.encode("Sure thing, here it is.", add_special_tokens=False)
    eos = tok.eos_token_id
    # EOS (or a stop token id: the worker's finish is STOP either way) ends a multi-token
    # chunk: every id and logprob stays, the text leaves the stop token out, usage counts it.
    for skip, include, want in ((True, False, "Sure thing, here it is."),
                                (False, False, "Sure thing, here it is."),
                                (False, True, "Sure thing, here it is.</s>")):
        (d,) = _run(tok, [_chunk(ids + [eos], FinishReason.STOP)], skip_special_tokens=skip,
                    include_stop_str_in_output=include, stop=["never"])
        assert d.text == want
        assert d.token_ids == ids + [eos] and len(d.logprobs) == len(ids) + 1
        assert (d.finish_reason, d.stop_reason) == (FinishReason.STOP, eos)
        assert d.usage is not None and d.usage.completion_tokens == len(ids) + 1
    # A stop string before the EOS wins: the output ends at its token, the EOS is dropped.
    (d,) = _run(tok, [_chunk(ids + [eos], FinishReason.STOP)], stop=["thing"])
    assert d.text == "Sure " and (d.finish_reason, d.stop_reason) == (FinishReason.STOP, "thing")
    assert eos not in d.token_ids and len(d.token_ids) < len(ids)
    assert d.usage is not None and d.usage.completion_tokens == len(d.token_ids)
    # max_tokens: the worker's last chunk is whole, its finish LENGTH, no stop reason.
    (d,) = _run(tok, [_chunk(ids, FinishReason.LENGTH)], max_tokens=len(ids), stop=["never"])
    assert d.text == "Sure thing, here it is." and d.token_ids == ids
    assert (d.finish_reason, d.stop_reason) == (FinishReason.LENGTH, None)
    assert d.usage is not None and d.usage.completion_tokens == len(ids)


def test_n_choices_usage_counts_each_choice_up_to_its_stop(tok: Any) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    sampling = dict(n=2, stop=["STOP HERE"], max_tokens=len(ids))
    k = len(_run(tok, [_chunk([t]) for t in ids], stop=["STOP HERE"], max_tokens=len(ids)))
    outs = _outputs(tok, **sampling)
    d0 = outs.add(_chunk(ids, index=0))
    assert d0 is not None and d0.finished and not d0.done and d0.token_ids == ids[:k]
    other = tok.encode("Nothing to see.", add_special_tokens=False)
    d1 = outs.add(_chunk(other, FinishReason.LENGTH, index=1))
    assert d1 is not None and d1.done and d1.finish_reason == FinishReason.LENGTH
    assert d1.usage is not None and d1.usage.completion_tokens == k + len(other)


def test_coalesced_deltas_keep_the_finish(tok: Any) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    sampling = dict(stop=["STOP HERE"], max_tokens=len(ids))
    deltas = _run(tok, [_chunk(ids[:4]), _chunk(ids[4:9]), _chunk(ids[9:], FinishReason.LENGTH)],
                  **sampling)
    assert len(deltas) >= 2
    m = merge(deltas)
    assert _summary([m]) == _summary(deltas)
    assert (m.finish_reason, m.stop_reason) == (FinishReason.STOP, "STOP HERE")
    assert m.usage is not None and m.usage.completion_tokens == len(m.token_ids)
