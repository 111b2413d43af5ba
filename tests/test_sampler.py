"""The sampler draws from the filtered distribution, keeps seeded requests reproducible whatever
shares their batch, and leaves greedy rows alone."""

from __future__ import annotations

import math

import torch

from kvrelay.engine.sampler import sample, seeded_generator, skip_draw
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence


def _seq(i: int, **kw: object) -> Sequence:
    return Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4, **kw))


def _logits(probs: list[float], rows: int) -> torch.Tensor:
    p = torch.tensor(probs)
    return p.clamp_min(1e-30).log().expand(rows, -1).contiguous()


def test_empirical_frequencies_match_the_distribution() -> None:
    probs = [0.05, 0.0, 0.5, 0.15, 0.3]
    rows = 4000
    seqs = [_seq(i, temperature=1.0) for i in range(rows)]
    tokens, _ = sample(_logits(probs, rows), seqs, seeded_generator(7, torch.device("cpu")))
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    assert counts[1] == 0  # a token of probability zero is never drawn
    for k, p in enumerate(probs):
        sigma = math.sqrt(rows * p * (1 - p)) + 1e-9
        assert abs(counts[k].item() - rows * p) <= 5 * sigma, (k, counts.tolist())


def test_top_k_and_top_p_are_never_escaped() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    rows = 2000
    g = seeded_generator(3, torch.device("cpu"))
    k2 = sample(_logits(probs, rows), [_seq(i, top_k=2) for i in range(rows)], g)[0]
    assert set(k2) == {0, 1}
    nucleus = sample(_logits(probs, rows), [_seq(i, top_p=0.65) for i in range(rows)], g)[0]
    assert set(nucleus) == {0, 1}  # 0.4 alone is short of 0.65; 0.4 + 0.3 covers it


def test_seeded_rows_ignore_their_batch_and_greedy_rows_take_the_argmax() -> None:
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    default = seeded_generator(11, torch.device("cpu"))

    def run(batch_extra: int) -> list[int]:
        seeded = _seq(0, temperature=0.8, seed=1234)
        others = [_seq(i + 1, temperature=1.0) for i in range(batch_extra)]
        greedy = _seq(99, temperature=0.0)
        out = []
        for _ in range(5):
            batch = [*others, seeded, greedy]
            toks, _ = sample(logits.expand(len(batch), -1).contiguous(), batch, default)
            assert toks[-1] == int(logits.argmax())
            out.append(toks[-2])
        return out

    assert run(0) == run(7) == run(31)


def test_skip_draw_equals_a_sampled_token() -> None:
    """A decode engine that did not sample the first token skips its draw: its stream then
    matches an engine that sampled every token."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(1))
    default = seeded_generator(0, torch.device("cpu"))
    full = _seq(0, temperature=1.0, seed=42)
    stream = [sample(logits, [full], default)[0][0] for _ in range(4)]
    resumed = _seq(1, temperature=1.0, seed=42)
    resumed.generator = seeded_generator(42, torch.device("cpu"))
    skip_draw(resumed.generator, torch.device("cpu"))
    assert [sample(logits, [resumed], default)[0][0] for _ in range(3)] == stream[1:]
