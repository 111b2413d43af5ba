"""What a peer must know about our KV tensor before it may write into it, and the check.

A ``KVLayout`` travels in every ``PeerInfo``. Two engines can exchange KV blocks only when every
property that decides the bytes of one (layer, K|V, block) region is the same: the protocol
version (which also fixes the tensor's dimension order), the model (``model_id``), layers, KV
heads, head size, block size, dtype, and the device kind. ``num_blocks`` may differ: each engine
sizes its cache from its own memory budget, and block ids are always the owner's.

Tensor parallelism: an engine of ``tp_size`` ranks has one KV tensor per rank, each holding the
KV heads ``head_ranges[rank]`` (``[start, stop)`` of the model's ``model_kv_heads``), and
``num_kv_heads`` is the count one rank holds (what sizes its blocks). The tensor-parallel sizes
of the two sides may differ: the sender writes each receiving rank exactly the heads it holds,
from whichever of its ranks holds them (:func:`head_runs`). Splits that do not tile the model's
heads are refused at the handshake (:func:`check_compatible`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.kv_transfer.errors import KVTransferError

if TYPE_CHECKING:
    import torch

# Bump whenever the tensor layout ([layers, planes, blocks, block_size, kv_heads, head_dim]) or
# the meaning of any field below changes.
# 2: tp_size, head_ranges, model_kv_heads. 3: a sliding-window layer is written only the blocks
# its receiver still reads, whose others the receiver must never serve as whole blocks
# (``engine/kv_window.py``): a v2 receiver would. 4: ``planes`` (1: MLA's latent, one plane per
# layer), which a v3 peer would take for K and V. 5: under tensor parallelism each rank's KV is
# in its own process, written by its own agent (``PeerInfo.rank_agents``), where a v4 peer writes
# every rank's through rank 0's; and ``heads_first``.
PROTOCOL_VERSION = 5
DEVICE_KINDS = ("cpu", "cuda")


class IncompatibleKVLayout(KVTransferError):
    """The peer's KV bytes do not mean what ours mean; the message says what to change."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message, retriable=False, peer=peer)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str
    model_id: str
    device_kind: str = "cpu"
    version: int = PROTOCOL_VERSION
    tp_size: int = 1
    head_ranges: tuple[tuple[int, int], ...] = ()  # per rank; () means one rank with them all
    model_kv_heads: int = 0  # 0 means num_kv_heads (no tensor parallelism)
    planes: int = 2  # per layer: K and V, or 1: a latent per token (multi-head latent attention)
    # The hybrid KV layout's plan (``KVGroups.signature``; "": one block table for every
    # layer). Under it ``num_layers`` counts the groups' slots and ``num_blocks`` their pages,
    # and a destination names a page per group of each block (``KVDestination.remote_pages``).
    kv_groups: str = ""
    # Inside a block each head's tokens together (``KVCacheSpec.heads_first``): a run of heads
    # is one contiguous region per (layer, plane, block), whatever the peer's split.
    heads_first: bool = False

    def __post_init__(self) -> None:
        self.spec  # noqa: B018 - validates the shape fields and the dtype
        if not self.model_kv_heads:
            object.__setattr__(self, "model_kv_heads", self.num_kv_heads)
        if not self.head_ranges:
            object.__setattr__(self, "head_ranges", ((0, self.num_kv_heads),) * self.tp_size)
        object.__setattr__(self, "head_ranges",
                           tuple((int(a), int(b)) for a, b in self.head_ranges))
        if self.tp_size < 1 or len(self.head_ranges) != self.tp_size:
            raise ValueError(f"KVLayout has tp_size {self.tp_size} but "
                             f"{len(self.head_ranges)} head ranges")
        if not self.model_id:
            raise ValueError("KVLayout.model_id must identify the model (see model_identity)")
        if self.device_kind not in DEVICE_KINDS:
            raise ValueError(f"KVLayout.device_kind must be one of {DEVICE_KINDS}, "
                             f"got {self.device_kind!r}")
        if not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"KVLayout.version must be a positive integer, got {self.version!r}")

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_id: str, device_kind: str = "cpu", *,
                  head_ranges: tuple[tuple[int, int], ...] = (),
                  model_kv_heads: int = 0) -> KVLayout:
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                   spec.num_blocks, spec.dtype, model_id, device_kind,
                   tp_size=max(1, len(head_ranges)), head_ranges=head_ranges,
                   model_kv_heads=model_kv_heads, planes=spec.planes,
                   kv_groups="" if spec.groups is None else spec.groups.signature,
                   heads_first=spec.heads_first)

    @property
    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                           self.num_blocks, self.dtype, planes=self.planes,
                           heads_first=self.heads_first)

    @property
    def kind(self) -> str:
        """What a token's KV is in this layout, in words (what a mismatch names)."""
        return "K and V per head (2 planes)" if self.planes == 2 else \
            "a latent per token (1 plane, multi-head latent attention)"

    @property
    def pages(self) -> str:
        """How blocks are addressed, in words (what a mismatch names)."""
        return f"pages per layer group ({self.kv_groups})" if self.kv_groups else \
            "one block table for every layer"

    @property
    def block_order(self) -> str:
        """How a block's KV is ordered, in words (what a mismatch names)."""
        return "heads, then tokens (heads first)" if self.heads_first else \
            "tokens, then heads"

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        version = d.get("version")
        if version != PROTOCOL_VERSION:
            # Refuse before reading fields whose meaning may have changed.
            raise IncompatibleKVLayout(
                f"peer speaks KV layout protocol v{version}, we speak v{PROTOCOL_VERSION}: "
                "run the same kvrelay version in the prefill and decode pools")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"malformed KV layout {d!r}: {e}") from None

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> KVLayout:
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed KV layout bytes: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"malformed KV layout: expected a JSON object, got {d!r}")
        return cls.from_dict(d)


# (field, what we say about it, the flag that makes both pools agree)
_CHECKS: tuple[tuple[str, str, str], ...] = (
    ("kind", "caches", "--model (the same checkpoint)"),
    ("model_id", "serves model", "--model (the same checkpoint)"),
    ("pages", "addresses KV blocks as", "--hybrid-kv (auto on both, or off on both)"),
    ("num_layers", "has num_layers", "--model (the same checkpoint)"),
    ("model_kv_heads", "has num_kv_heads", "--model (the same checkpoint)"),
    ("head_dim", "has head_dim", "--model (the same checkpoint)"),
    ("block_size", "has block_size", "--block-size"),
    ("block_order", "orders a block's KV as", "--kv-layout (tokens on both, or heads on both)"),
    ("dtype", "stores KV as", "--kv-cache-dtype (or --dtype, which it follows by default)"),
    ("device_kind", "keeps KV on", "--device kind (cpu or cuda)"),
)


def layout_differences(local: KVLayout, remote: KVLayout) -> list[str]:
    """One actionable sentence per property that differs (empty when compatible)."""
    if local.version != remote.version:
        return [f"peer speaks KV layout protocol v{remote.version}, we speak v{local.version}: "
                "run the same kvrelay version in both pools"]
    out = []
    for name, what, flag in _CHECKS:
        if name == "num_layers" and local.kv_groups != remote.kv_groups:
            continue  # slots, not layers, under the hybrid layout: ``pages`` says it
        theirs, ours = getattr(remote, name), getattr(local, name)
        if theirs != ours:
            out.append(f"peer {what} {theirs}, we have {ours}: start both pools with the "
                       f"same {flag}")
    if not out:
        out += [f"peer's {e}" for e in split_errors(remote)]
        out += [f"our {e}" for e in split_errors(local)]
    return out


def split_errors(layout: KVLayout) -> list[str]:
    """Why ``layout``'s split of KV heads over its ranks cannot be mapped onto another split
    (empty when it can): every rank must hold ``num_kv_heads`` consecutive heads, and together
    they must hold every head of the model."""
    n, total = layout.num_kv_heads, layout.model_kv_heads
    bad = [(a, b) for a, b in layout.head_ranges if b - a != n or a < 0 or b > total]
    if bad:
        return [f"tensor-parallel split of {total} KV heads over {layout.tp_size} ranks has "
                f"ranges {list(bad)} that are not {n} heads within [0, {total}): the KV heads "
                f"and --tensor-parallel-size must divide one another"]
    held = set().union(*(range(a, b) for a, b in layout.head_ranges))
    if len(held) != total:
        return [f"tensor-parallel split over {layout.tp_size} ranks holds KV heads "
                f"{sorted(held)} of {total}: the KV heads and --tensor-parallel-size must "
                f"divide one another"]
    return []


class HeadRun(NamedTuple):
    """Heads ``[src_head, src_head + count)`` of sending rank ``src`` go to heads
    ``[dst_head, ...)`` (offsets within each rank's tensor) of receiving rank ``dst``."""

    src: int
    dst: int
    src_head: int
    dst_head: int
    count: int


def head_runs(local: KVLayout, remote: KVLayout) -> list[HeadRun]:
    """Which of our ranks writes which heads of each of the peer's ranks: every head of every
    receiving rank once, from the first of our ranks that holds it, in runs of consecutive
    heads. Assumes :func:`check_compatible` passed."""
    out: list[HeadRun] = []
    for d, (da, db) in enumerate(remote.head_ranges):
        for h in range(da, db):
            s = next(r for r, (a, b) in enumerate(local.head_ranges) if a <= h < b)
            sa = local.head_ranges[s][0]
            last = out[-1] if out else None
            if (last is not None and last.dst == d and last.src == s
                    and last.src_head + last.count == h - sa
                    and last.dst_head + last.count == h - da):
                out[-1] = last._replace(count=last.count + 1)
            else:
                out.append(HeadRun(s, d, h - sa, h - da, 1))
    return out


def check_compatible(local: KVLayout, remote: KVLayout, *, peer: str | None = None) -> None:
    """Raise ``IncompatibleKVLayout`` naming every difference and the flag that fixes it."""
    diffs = layout_differences(local, remote)
    if diffs:
        who = f"peer {peer!r}" if peer else "peer"
        raise IncompatibleKVLayout(f"KV layout of {who} is incompatible with ours: "
                                   + "; ".join(diffs), peer=peer)


def model_identity(model_dir: str, *, sample_bytes: int = 1 << 16) -> str:
    """A short fingerprint of a checkpoint: its config plus a sample of every weight file.

    Two engines whose KV should be interchangeable must load the same weights, not merely the
    same architecture, so the config alone is not enough; hashing whole files would cost seconds
    per GB at startup, so each ``*.safetensors`` contributes its name, size and its first and
    last ``sample_bytes`` (which include the header and real weights).
    """
    h = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        config = json.load(f)
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        h.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(sample_bytes))
            f.seek(max(0, size - sample_bytes))
            h.update(f.read(sample_bytes))
    return h.hexdigest()[:16]


def device_kind_of(device: Any) -> str:
    """'cpu' or 'cuda' for a torch device (or its string)."""
    kind = str(device).split(":", 1)[0]
    if kind not in DEVICE_KINDS:
        raise ValueError(f"KV transfer supports {DEVICE_KINDS} tensors, not {device}")
    return kind


def check_kv_tensors(layout: KVLayout, tensors: Sequence[torch.Tensor],
                     slots: Sequence[int] | None = None) -> None:
    """Raise ValueError unless ``tensors`` (the KV of transport ranks ``slots``, default all of
    ``layout``'s, in order) are what ``layout`` describes, and can be registered with NIXL as one
    region each."""
    spec = layout.spec
    slots = range(layout.tp_size) if slots is None else slots
    if len(tensors) != len(slots) or not len(slots):
        raise ValueError(f"{len(tensors)} KV tensors for transport ranks {list(slots)}")
    if min(slots) < 0 or max(slots) >= layout.tp_size or len(set(slots)) != len(slots):
        raise ValueError(f"transport ranks {list(slots)} are not distinct ranks of "
                         f"{layout.tp_size}")
    for t in tensors:
        if tuple(t.shape) != spec.shape or t.dtype != spec.torch_dtype:
            raise ValueError(f"KV tensor {tuple(t.shape)} {t.dtype} does not match the "
                             f"layout {spec.shape} {spec.torch_dtype}")
        if not t.is_contiguous():
            raise ValueError("a KV tensor must be contiguous to be registered as one region")
    kv = tensors[0]
    if device_kind_of(kv.device) != layout.device_kind:
        raise ValueError(f"KV tensor is on {kv.device}, layout says {layout.device_kind}")


__all__ = [
    "DEVICE_KINDS",
    "PROTOCOL_VERSION",
    "HeadRun",
    "IncompatibleKVLayout",
    "KVLayout",
    "check_compatible",
    "check_kv_tensors",
    "device_kind_of",
    "head_runs",
    "layout_differences",
    "model_identity",
    "split_errors",
]

