"""Chained hashes of full KV blocks: the identity of a cached prefix.

Block ``i``'s hash covers its own token ids and the hash of block ``i-1``, so equal hashes mean
equal prefixes (a collision is caught by comparing stored token ids). The function is stable
across processes and machines (no Python ``hash``), so a router can compute the same hashes
from a prompt and compare them with what workers report. Pure Python: no torch import.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0
# Names this scheme (chained 8-byte BLAKE2b over int64 token ids, salts rooted by salt_root):
# engines and routers that hash differently must refuse each other rather than never hit.
HASH_SCHEME = "blake2b64-chain-v1"
MAX_CACHE_SALT = 256  # characters


def salt_root(cache_salt: str | None) -> int:
    """The chain's root for a request's ``cache_salt`` (vLLM's name): requests share cached
    blocks only when their salts are equal, so one tenant cannot probe another's prompts
    through ``cached_tokens`` or time to first token. No salt: ``ROOT_HASH``."""
    if not cache_salt:
        return ROOT_HASH
    h = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"kvrelay-salt")
    return int.from_bytes(h.digest(), "little") or 1


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every *full* block of ``token_ids`` (a partial tail block has none).

    Equal to chaining ``hash_block`` block by block (the router calls this on every prompt, so
    the token ids are packed once, not once per block)."""
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    packed = array("q", token_ids[:n_full * block_size]).tobytes()
    step = block_size * 8
    out: list[int] = []
    for start in range(0, n_full * step, step):
        h = hashlib.blake2b(digest_size=8)
        h.update(parent.to_bytes(8, "little"))
        h.update(packed[start:start + step])
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out
