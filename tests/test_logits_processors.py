"""Penalties, logit_bias, bad words, min_tokens and allowed_token_ids: the engine's vectorized
edits equal a plain per-token reference, on random logits and through greedy decoding against
transformers."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import ARCHS, hf_forward_logits
from test_engine_parity import make_core, run

from kvrelay.engine.sampler import apply_logits_processors
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams,
              eos: frozenset[int] = frozenset()) -> torch.Tensor:
    """vLLM's math, one token at a time."""
    x = logits.clone().double()
    if sp.allowed_token_ids is not None:
        for t in range(x.shape[0]):
            if t not in sp.allowed_token_ids:
                x[t] = float("-inf")
    for t, b in sp.logit_bias:
        x[t] += b
    for word in sp.bad_words_token_ids:  # vLLM: ban the last token once the rest was output
        *head, last = word
        if not head or output[-len(head):] == head:
            x[last] = float("-inf")
    if len(output) < sp.min_tokens:
        for t in set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos)):
            x[t] = float("-inf")
    for t in set(prompt) | set(output):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(output):
        x[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return x.float()


def _seq(prompt: list[int], output: list[int], sp: SamplingParams) -> Sequence:
    s = Sequence("r", prompt, sp)
    for t in output:
        s.append_token(t)
    return s


def test_batch_edits_equal_the_reference_row_by_row() -> None:
    rng = random.Random(0)
    vocab = 64
    cases = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8, frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(logit_bias={3: 100, 7: -100, 9: 2.5}),
        SamplingParams(min_tokens=5, stop_token_ids=[11]),
        SamplingParams(min_tokens=2, stop_token_ids=[11], ignore_eos=True),
        SamplingParams(allowed_token_ids=[1, 4, 9, 30], logit_bias={4: -3}),
        SamplingParams(bad_words_token_ids=[[5], [6, 7], [8, 9, 10], [12, 13]]),
    ]
    seqs, prompts, outputs = [], [], []
    for sp in cases:
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        if sp.bad_words_token_ids:
            output = [1, 8, 9, 12]  # [8, 9, 10]'s head was output, [12, 13]'s, [6, 7]'s not
        seqs.append(_seq(prompt, output, sp))
        prompts.append(prompt)
        outputs.append(output)
    logits = torch.randn(len(cases), vocab, generator=torch.Generator().manual_seed(1)) * 3
    eos = frozenset({2})
    got = apply_logits_processors(logits, seqs, eos)
    for i, sp in enumerate(cases):
        want = reference(logits[i], prompts[i], outputs[i], sp, eos)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5, msg=f"case {i}: {sp}")
    assert got[0].equal(logits[0])
    # min_tokens masked EOS and the stop token while short of them
    assert got[5, 2] == float("-inf") and got[5, 11] == float("-inf")
    bad = got[len(cases) - 1].isneginf().nonzero().flatten().tolist()
    assert bad == [5, 13], bad  # [8, 9, 10]: the output ends with 9, 12, not 8, 9
    plain = [_seq([1, 2], [3], SamplingParams()) for _ in range(4)]
    x = torch.randn(4, vocab)
    assert apply_logits_processors(x, plain, eos) is x  # nothing asked: no copy, no work


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, presence_penalty=1.5,
                   frequency_penalty=1.0, logit_bias={5: 4.0, 9: -100}),
    None,  # bad words: built from the plain output below
], ids=["repetition", "presence-frequency-bias", "bad-words"])
def test_greedy_with_penalties_matches_a_transformers_reference_loop(hf_model_dir, sp) -> None:
    model_dir = hf_model_dir(sorted(ARCHS)[0])
    rng = random.Random(5)
    prompt = [rng.randrange(3, 60) for _ in range(30)]  # repeats: the penalty has work to do
    core = make_core(model_dir)
    plain_sp = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    if sp is None:  # ban a token pair greedy decoding outputs, and one of its single tokens
        plain = run(core, {"plain": (prompt, plain_sp)})["plain"]
        sp = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True,
                            bad_words_token_ids=[plain[3:5], plain[8:9]])
    got = run(core, {"p": (prompt, sp), "plain": (prompt, plain_sp)})
    out: list[int] = []
    for _ in range(sp.max_tokens):
        last = hf_forward_logits(model_dir, prompt + out)[-1]
        out.append(int(reference(last, prompt, out, sp).argmax()))
    assert got["p"] == out
    assert got["p"] != got["plain"], "the penalty changed nothing: a vacuous test"


def test_min_tokens_holds_off_eos(hf_model_dir) -> None:
    model_dir = hf_model_dir(sorted(ARCHS)[0])
    core = make_core(model_dir)
    prompt = [7, 8, 9, 10]
    free = run(core, {"a": (prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True))})["a"]
    stop = free[0]  # the token greedy decoding picks first becomes a stop token
    got = run(core, {"b": (prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[stop], min_tokens=3))})["b"]
    assert stop not in got[:3] and len(got) >= 3
    short = run(core, {"c": (prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True, stop_token_ids=[stop]))})
    assert short["c"] == [stop]


@pytest.mark.parametrize("kw, msg", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, r"\[-100, 100\]"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[]]}, "bad word"),
    ({"bad_words_token_ids": [[1]] * 257}, "bad words"),
    ({"bad_words_token_ids": [[-1]]}, "bad word token ids"),
])
def test_bad_values_are_refused(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_token_ids_outside_the_vocabulary_are_refused(hf_model_dir) -> None:
    core = make_core(hf_model_dir(sorted(ARCHS)[0]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request("x", [1, 2], SamplingParams(logit_bias={core.vocab_size: 1.0}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request("y", [1, 2], SamplingParams(bad_words_token_ids=[[1, core.vocab_size]]))


def test_bad_words_cross_the_wire() -> None:
    from kvrelay.common.convert import sampling_from_proto, sampling_to_proto

    sp = SamplingParams(bad_words_token_ids=[[3], [4, 5, 6]])
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    assert sp.bad_words_token_ids == ((3,), (4, 5, 6))
