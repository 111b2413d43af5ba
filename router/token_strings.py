"""Token ids as the text the OpenAI API's logprobs show for them, one string per id.

A response with logprobs names each output token and its top alternatives by text:
n x max_tokens x (1 + top_logprobs) ids, 21 per token at top_logprobs=20. Decoded one id at a
time on the event loop (12 us each with a small vocabulary, more with a large one) that was
seconds of stall for one request, and every other request on the router waited (issue 54).
Here a chunk's ids are looked up in a cache of the strings decoded so far (at most one per id
of the vocabulary), and the ids missing from it are decoded together: in one call to the Rust
tokenizer where that gives what ``tokenizer.decode([id])`` gives (checked once, at start), on
the tokenizer threads when there are more than a few.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

# Ids missing from the cache decoded on the event loop (a batch of 64 takes ~0.2 ms); more go
# to the tokenizer threads.
INLINE_IDS = 64
# Ids whose one-id decode and batched decode are compared before the batch is trusted.
CHECK_IDS = 512

OffLoop = Callable[..., Awaitable[Any]]  # (fn, *args) -> fn(*args), run off the event loop


class TokenStrings:
    """``cache[id]`` once ``prefetch`` has seen the id (it holds at most one string per id
    the workers produce: the model's vocabulary); ``off_loop(fn, *args)`` runs a decode of
    many ids where it does not block the event loop."""

    def __init__(self, tokenizer: Any, off_loop: OffLoop, vocab_size: int):
        self.tokenizer = tokenizer
        self.off_loop = off_loop
        self.vocab_size = vocab_size
        self.cache: dict[int, str] = {}
        self._batched = self._check_batch()

    def get(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        return s if s is not None else self.decode_each([token_id])[0]

    async def prefetch(self, token_ids: Iterable[int]) -> None:
        """Decode, together, the ids of ``token_ids`` not decoded yet (off the loop when
        there are more than ``INLINE_IDS``)."""
        cache = self.cache
        missing = sorted(set(token_ids).difference(cache))
        if not missing:
            return
        if len(missing) > INLINE_IDS:
            strings = await self.off_loop(self.decode_each, missing)
        else:
            strings = self.decode_each(missing)
        cache.update(zip(missing, strings, strict=True))

    def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's own text, as ``tokenizer.decode([id])`` gives it."""
        if self._batched:
            backend = self.tokenizer.backend_tokenizer
            return list(backend.decode_batch([[t] for t in token_ids],
                                             skip_special_tokens=False))
        return [self.tokenizer.decode([t]) for t in token_ids]

    def _check_batch(self) -> bool:
        """Whether the Rust tokenizer's batched decode gives what ``decode([id])`` does for
        this tokenizer (a Python-side clean-up, or a slow tokenizer, would differ)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return False
        try:
            n = min(self.vocab_size, len(self.tokenizer))
        except TypeError:  # a wrapper without __len__
            n = min(self.vocab_size, CHECK_IDS)
        ids = sorted({*range(min(n, CHECK_IDS)), *range(max(0, n - 64), n),
                      *(getattr(self.tokenizer, "all_special_ids", None) or [])})
        ids = [t for t in ids if 0 <= t < n]
        try:
            batched = backend.decode_batch([[t] for t in ids], skip_special_tokens=False)
        except Exception:  # an odd backend: the one-id decode is always right
            return False
        return list(batched) == [self.tokenizer.decode([t]) for t in ids]
