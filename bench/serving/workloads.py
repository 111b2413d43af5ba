"""Benchmark workloads: seeded token-id prompts and Poisson arrival schedules.

Prompts are lists of token ids drawn uniformly from the model's tokenizer vocabulary (special
tokens excluded), so every server sees exactly the same prompt lengths whatever its tokenizer
does with text. Each (seed, tag) pair gives the same prompts on every run and every server; use a
distinct tag per run against one server so no run hits the prefix cache warmed by another.

Workloads (input tokens -> output tokens):

* ``uniform``: 256 -> 32
* ``long``: 2048 -> 64
* ``mixed``: 90 % 256 -> 32, 10 % 2048 -> 64 (exact counts, shuffled with the seed)
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a workload."""

    name: str
    prompt_tokens: int
    max_tokens: int
    weight: float = 1.0


@dataclass(frozen=True)
class Workload:
    name: str
    classes: tuple[RequestClass, ...]

    def describe(self) -> str:
        total = sum(c.weight for c in self.classes)
        return ", ".join(f"{100 * c.weight / total:.0f}% {c.prompt_tokens}->{c.max_tokens}"
                         for c in self.classes)


SHORT = RequestClass("short", 256, 32)
LONG = RequestClass("long", 2048, 64)

WORKLOADS: dict[str, Workload] = {
    "uniform": Workload("uniform", (SHORT,)),
    "long": Workload("long", (LONG,)),
    "mixed": Workload("mixed", (RequestClass("short", 256, 32, 0.9),
                                RequestClass("long", 2048, 64, 0.1))),
}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: its prompt token ids and output length."""

    index: int
    kind: str
    prompt_token_ids: list[int] = field(repr=False)
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Vocab:
    """The ids a prompt may use: ``[0, size)`` less the special ones."""

    size: int
    special_ids: frozenset[int] = frozenset()

    def usable(self) -> list[int]:
        ids = [i for i in range(self.size) if i not in self.special_ids]
        if not ids:
            raise ValueError("the vocabulary has no non-special token")
        return ids


def read_vocab(model_dir: str | os.PathLike[str]) -> Vocab:
    """The vocabulary of a checkpoint directory, from ``tokenizer.json`` (and ``config.json``).

    The size is the tokenizer's (highest id + 1), capped by the model's ``vocab_size`` when that
    is smaller; added tokens marked special (BOS/EOS/chat markers) are excluded from prompts.
    """
    model_dir = os.fspath(model_dir)
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(f"no tokenizer.json in {model_dir!r}")
    with open(tok_path, encoding="utf-8") as f:
        tok = json.load(f)
    vocab = tok.get("model", {}).get("vocab") or {}
    if isinstance(vocab, dict):
        ids = list(vocab.values())
    else:  # Unigram: a list of [piece, score]
        ids = list(range(len(vocab)))
    added = tok.get("added_tokens") or []
    ids += [int(t["id"]) for t in added]
    if not ids:
        raise ValueError(f"{tok_path} lists no tokens")
    size = max(ids) + 1
    cfg_path = os.path.join(model_dir, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            model_vocab = json.load(f).get("vocab_size")
        if isinstance(model_vocab, int) and 0 < model_vocab < size:
            size = model_vocab
    special = frozenset(int(t["id"]) for t in added if t.get("special", False))
    return Vocab(size=size, special_ids=special)


def _class_counts(workload: Workload, n: int) -> list[int]:
    """Exact per-class counts for ``n`` requests (largest remainder)."""
    total = sum(c.weight for c in workload.classes)
    raw = [n * c.weight / total for c in workload.classes]
    counts = [math.floor(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def make_requests(workload: Workload | str, num_requests: int, vocab: Vocab, seed: int,
                  tag: str = "") -> list[RequestSpec]:
    """``num_requests`` requests of ``workload`` with random prompts, fixed by ``(seed, tag)``."""
    wl = WORKLOADS[workload] if isinstance(workload, str) else workload
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    rng = random.Random(f"kvrelay-bench:{seed}:{wl.name}:{tag}:prompts")
    kinds: list[RequestClass] = []
    for cls, count in zip(wl.classes, _class_counts(wl, num_requests), strict=True):
        kinds += [cls] * count
    rng.shuffle(kinds)
    usable = vocab.usable()
    return [RequestSpec(index=i, kind=cls.name,
                        prompt_token_ids=rng.choices(usable, k=cls.prompt_tokens),
                        max_tokens=cls.max_tokens)
            for i, cls in enumerate(kinds)]


def poisson_arrivals(num_requests: int, rate: float, seed: int, tag: str = "") -> list[float]:
    """Send offsets in seconds for a Poisson process of ``rate`` requests/s, first at 0.

    ``rate`` of ``inf`` (or <= 0) means saturation: every request at once. For a fixed
    ``(seed, tag)`` the schedules of different rates are the same unit-rate pattern scaled by
    ``1 / rate``, so a rate sweep changes only the pace, never the order of gaps.
    """
    if num_requests <= 0:
        return []
    if rate <= 0 or math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"kvrelay-bench:{seed}:{tag}:arrivals")
    out, t = [0.0], 0.0
    for _ in range(num_requests - 1):
        t += rng.expovariate(1.0)
        out.append(t / rate)
    return out
