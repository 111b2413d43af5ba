"""The KV layout a worker registers with, and the router's check of it (the handshake).

A prefix-aware router credits a worker for the prompt blocks whose hashes it reports, and a
prefill worker writes its KV into a decode worker's blocks. Both are only right when every
worker means the same thing by a block hash: the same model (``model_identity``), the same
tokens per block (``block_size``), the same KV element type (``kv_dtype``: a bf16 KV pool
cannot take a float32 prefill's bytes), the same kind of KV (``kv_kind``: K and V per head, or
multi-head latent attention's one latent per token), the same order inside a block
(``block_order``: tokens or heads first, ``--kv-layout``), the same addressing (``kv_pages``: one
block table, or the hybrid layout's pages per layer group, ``--hybrid-kv``), and the same hash
function, salts included
(``hash_scheme``, ``hash_probe``). A worker that differs is refused at registration with a
message naming the field and both values, not admitted to serve zero hits (or, for a prefill
worker whose KV dtype differs from the decode pool's, never to serve at all: each of its
transfers was refused by the peer's layout check, ``kv_transfer/layout.py``, which remains the
check of the tensor's shape itself once two workers connect).

Pure Python (no torch): the router imports it. The hash function is the engine's
(``engine/prefix_hash.py``), which the router also hashes prompts with: ``hash_probe`` is its
hash of a fixed block under a fixed salt, so two builds that name the same scheme but hash (or
derive salt roots) differently still differ, and a worker that hashes unlike this router is
refused whatever the other workers do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# HASH_SCHEME names the prefix-hash scheme of engine/prefix_hash.py, beside the function it
# names: blocks chained by 8-byte BLAKE2b over the parent hash and the block's int64 token ids,
# a cache_salt's chain rooted at salt_root (BLAKE2b personalised "kvrelay-salt").
from kvrelay.engine.prefix_hash import HASH_SCHEME, block_hashes, salt_root
from kvrelay.proto import worker_pb2 as wpb

# Bump when a field is added to, or changes meaning in, the handshake. 2: kv_kind.
# 3: block_order, kv_pages.
LAYOUT_VERSION = 3
# What a token's KV is (``kv_kind``): K and V per head, or one latent (MLA).
KV_KINDS = ("kv", "latent")
BLOCK_ORDERS = ("tokens", "heads")  # ``block_order``
_PROBE_TOKENS = tuple(range(1, 17))
_PROBE_SALT = "kvrelay-layout-probe"
MAX_FIELD_LEN = 64  # characters of kv_dtype and hash_scheme a beat may carry
MAX_PAGES_LEN = 2048  # of kv_pages: a layer-group plan lists every layer

__all__ = ["BLOCK_ORDERS", "HASH_SCHEME", "KV_KINDS", "LAYOUT_VERSION", "CacheLayout",
           "KVLayoutMismatch", "check", "check_hashing", "differences", "hash_probe", "validate"]


@functools.cache
def hash_probe() -> int:
    """This process's hashes of the probe block (16 tokens), unsalted and under the probe
    salt, combined: it changes with the hash function, the unsalted root and the derivation
    of a salt's root."""
    n = len(_PROBE_TOKENS)
    return (block_hashes(_PROBE_TOKENS, n, salt_root(None))[-1]
            ^ block_hashes(_PROBE_TOKENS, n, salt_root(_PROBE_SALT))[-1])


class KVLayoutMismatch(ValueError):
    """A worker's layout differs from the one it is checked against; the message names every
    differing field with both values and what to change."""


@dataclass(frozen=True)
class CacheLayout:
    model_identity: str
    block_size: int
    kv_dtype: str
    hash_scheme: str = HASH_SCHEME
    hash_probe: int = 0  # 0: this process's (see ``local``)
    version: int = LAYOUT_VERSION
    kv_kind: str = "kv"
    block_order: str = "tokens"
    kv_pages: str = ""

    @classmethod
    def local(cls, model_identity: str, block_size: int, kv_dtype: str,
              kv_kind: str = "kv", block_order: str = "tokens",
              kv_pages: str = "") -> CacheLayout:
        """This process's layout for a KV cache of ``block_size`` tokens of ``kv_dtype``, of
        ``kv_kind`` ("kv" or "latent"), ordered ``block_order`` inside a block, addressed by
        ``kv_pages`` ("": one block table)."""
        return cls(model_identity, block_size, kv_dtype, HASH_SCHEME, hash_probe(),
                   kv_kind=kv_kind, block_order=block_order, kv_pages=kv_pages)

    def to_proto(self) -> wpb.CacheLayout:
        return wpb.CacheLayout(version=self.version, kv_dtype=self.kv_dtype,
                               hash_scheme=self.hash_scheme, hash_probe=self.hash_probe,
                               kv_kind=self.kv_kind, block_order=self.block_order,
                               kv_pages=self.kv_pages)

    @classmethod
    def from_info(cls, info: wpb.WorkerInfo) -> CacheLayout | None:
        """The layout a beat's ``WorkerInfo`` reports (None: it reports none)."""
        if not info.HasField("kv_layout"):
            return None
        kl = info.kv_layout
        return cls(info.model_identity, info.block_size, kl.kv_dtype, kl.hash_scheme,
                   kl.hash_probe, kl.version, kl.kv_kind or "kv", kl.block_order or "tokens",
                   kl.kv_pages)


# (field, what it is, what makes two processes agree on it)
_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("model_identity", "model", "start every worker with the same --model (checkpoint)"),
    ("block_size", "tokens per KV block", "start every worker with the same --block-size"),
    ("kv_dtype", "KV cache dtype", "start every worker with the same --kv-cache-dtype (or "
     "--dtype, which it follows by default)"),
    ("kv_kind", "KV cache kind: 'kv' per head or 'latent' (MLA)", "start every worker with the "
     "same --model (a latent cache and per-head K/V never mix)"),
    ("block_order", "order of a KV block: 'tokens' or 'heads' first", "start every worker with "
     "the same --kv-layout (its auto follows the device: heads on CUDA, tokens on CPU)"),
    ("kv_pages", "KV block addressing: '' one table, else the hybrid layout's layer groups",
     "start every worker with the same --hybrid-kv"),
    ("hash_scheme", "prefix-hash scheme", "run the same kvrelay version everywhere"),
    ("hash_probe", "prefix hash of the probe block", "run the same kvrelay version everywhere "
     "(same scheme name, different hashing)"),
)


def _show(name: str, value: object) -> str:
    return f"{value:#018x}" if name == "hash_probe" else repr(value)


def differences(theirs: CacheLayout, ours: CacheLayout, *, fields: tuple[str, ...] = (),
                them: str = "worker", us: str = "the workers this router routes to") -> list[str]:
    """One sentence per field of ``fields`` (default: all) in which ``theirs`` (of ``them``)
    differs from ``ours`` (of ``us``), naming the field, both values and the fix; empty when
    they agree."""
    if theirs.version != ours.version:
        return [f"version (of this handshake) differs: {theirs.version} on {them}, "
                f"{ours.version} on {us}: run the same kvrelay version everywhere"]
    out = []
    for name, what, fix in _FIELDS:
        if fields and name not in fields:
            continue
        a, b = getattr(theirs, name), getattr(ours, name)
        if a != b:
            out.append(f"{name} ({what}) differs: {_show(name, a)} on {them}, "
                       f"{_show(name, b)} on {us}: {fix}")
    return out


def check(theirs: CacheLayout, ours: CacheLayout, *, fields: tuple[str, ...] = (),
          them: str = "worker", us: str = "the workers this router routes to") -> None:
    """Raise ``KVLayoutMismatch`` naming every difference (see ``differences``)."""
    diffs = differences(theirs, ours, fields=fields, them=them, us=us)
    if diffs:
        raise KVLayoutMismatch("KV layout mismatch, registration refused: " + "; ".join(diffs))


def check_hashing(theirs: CacheLayout, *, them: str = "worker") -> None:
    """Raise ``KVLayoutMismatch`` unless ``theirs`` hashes prefix blocks as this process does
    (the router hashes every prompt to match it against what workers report)."""
    ours = CacheLayout(theirs.model_identity, theirs.block_size, theirs.kv_dtype, HASH_SCHEME,
                       hash_probe())
    check(theirs, ours, fields=("hash_scheme", "hash_probe"), them=them, us="this router")


def validate(layout: wpb.CacheLayout) -> None:
    """Raise ValueError when a beat's layout is out of bounds (it is kept per worker)."""
    if len(layout.kv_dtype) > MAX_FIELD_LEN or len(layout.hash_scheme) > MAX_FIELD_LEN:
        raise ValueError(f"kv_layout's kv_dtype and hash_scheme take at most {MAX_FIELD_LEN} "
                         f"characters")
    if not layout.kv_dtype or not layout.hash_scheme:
        raise ValueError("kv_layout needs a kv_dtype and a hash_scheme")
    if layout.kv_kind not in ("", *KV_KINDS):
        raise ValueError(f"kv_layout's kv_kind must be one of {KV_KINDS}, got "
                         f"{layout.kv_kind[:MAX_FIELD_LEN]!r}")
    if layout.block_order not in ("", *BLOCK_ORDERS):
        raise ValueError(f"kv_layout's block_order must be one of {BLOCK_ORDERS}, got "
                         f"{layout.block_order[:MAX_FIELD_LEN]!r}")
    if len(layout.kv_pages) > MAX_PAGES_LEN:
        raise ValueError(f"kv_layout's kv_pages takes at most {MAX_PAGES_LEN} characters")
