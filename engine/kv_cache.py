"""The one preallocated paged KV tensor and how it is sized.

Layout: ``[num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim]``: two planes (K,
V) per layer, or one where the model caches a latent per token instead (multi-head latent
attention, DeepSeek's: one "head" of the latent and its rope key, ``models/mla.py``). A token's
slot is ``block_id * block_size + offset``; each layer gets views of its planes. This one
tensor is what a KV transport registers, so its address arithmetic lives here, in one place.

Heads first (``KVCacheSpec.heads_first``, ``--kv-layout heads``): inside a block each head's tokens
are together, ``[..., num_blocks, num_kv_heads, block_size, head_dim]``, so the heads a peer of
another tensor-parallel split holds are one contiguous run per (layer, plane, block). Layers
read it through :func:`plane_view`: a ``[num_blocks, block_size, kv_heads, head_dim]`` view
with the head stride outside the token's (flash-attn and SDPA read strides); the CPU's native
kernels read the token-major layout only.

KV head groups (``CacheConfig.kv_head_groups`` = G > 1): ``[G, ...]`` of that layout, group g
holding KV heads ``[g * H / G, (g + 1) * H / G)``: each group is laid out as a rank of a
tensor-parallel replica of G ranks lays out its KV, and the transport registers the groups as
such ranks, so KV moves between a replica of TP=G and this engine rank to rank, whole blocks,
where one tensor would make the sender repack every token's heads first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.hybrid_kv import KVGroups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one engine's KV cache; everything a peer needs to address its bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str = "float32"
    # Each layer's sliding window (None: full attention; empty: none known). Not part of the
    # layout: a sender writes a windowed layer only the blocks its receiver will still read
    # (``kv_window.py``).
    layer_windows: tuple[int | None, ...] = ()
    # Planes per layer: 2 (K and V per head) or 1 (a latent per token: MLA). Part of the layout.
    planes: int = 2
    # The hybrid KV layout's layer groups (``hybrid_kv.py``): ``num_layers`` then counts the
    # groups' k slots and ``num_blocks`` their pages, and layer l of block i lives in slot
    # ``groups.slot_of[l]`` of block i's page of group ``groups.group_of[l]``. Part of the layout.
    groups: KVGroups | None = None
    # Each head's tokens together inside a block (see the module docstring). Part of the layout.
    heads_first: bool = False

    def __post_init__(self) -> None:
        if self.planes not in (1, 2):
            raise ValueError(f"KVCacheSpec.planes must be 1 (latent) or 2 (K, V), "
                             f"got {self.planes}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        dtype_from_name(self.dtype)

    @property
    def model_layers(self) -> int:
        """The model's layers (``num_layers`` counts slots under the hybrid layout)."""
        return self.num_layers if self.groups is None else len(self.groups.group_of)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The tensor's shape as stored (heads before tokens under ``heads_first``)."""
        inner = (self.num_kv_heads, self.block_size) if self.heads_first else \
            (self.block_size, self.num_kv_heads)
        return (self.num_layers, self.planes, self.num_blocks, *inner, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane (K, V or latent) of one layer: the unit a transport
        moves."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block_all_layers(self) -> int:
        """Bytes one block id costs across all layers and planes (used for sizing)."""
        return self.planes * self.num_layers * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block_all_layers

    def plane_block_offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of (layer, plane ``kv``: K=0/V=1, or 0 the latent, block) from the start
        of the tensor."""
        assert 0 <= layer < self.num_layers and 0 <= kv < self.planes \
            and 0 <= block < self.num_blocks
        return ((layer * self.planes + kv) * self.num_blocks + block) * self.block_bytes


def blocks_for_budget(
    budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: str, planes: int = 2,
) -> int:
    """How many blocks fit in ``budget_bytes``."""
    probe = KVCacheSpec(num_layers, num_kv_heads, head_dim, block_size, 1, dtype, planes=planes)
    n = budget_bytes // probe.bytes_per_block_all_layers
    if n < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds no block: one block needs "
            f"{probe.bytes_per_block_all_layers} bytes (layers={num_layers}, "
            f"kv_heads={num_kv_heads}, head_dim={head_dim}, block_size={block_size}, {dtype}, "
            f"planes={planes})"
        )
    return int(n)


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device | str = "cpu",
                      groups: int = 1) -> torch.Tensor:
    """Allocate the cache zero-filled: padded attention gathers may read never-written slots.
    ``groups`` > 1 (KV head groups): ``[groups, *spec.shape]``, ``spec`` one group's."""
    return torch.zeros(kv_shape(spec, groups), dtype=spec.torch_dtype, device=device)


def kv_groups_of(kv: torch.Tensor) -> list[torch.Tensor]:
    """The head groups of an engine's KV tensor, each a contiguous ``spec.shape`` tensor (one:
    the tensor itself)."""
    return [kv] if kv.dim() == 6 else list(kv.unbind(0))


def kv_shape(spec: KVCacheSpec, groups: int) -> tuple[int, ...]:
    return spec.shape if groups == 1 else (groups, *spec.shape)


def group_head_ranges(heads: range, groups: int) -> list[tuple[int, int]]:
    """The model's KV heads each of ``groups`` head groups holds, of an engine (a rank) holding
    ``heads``."""
    n = len(heads) // groups
    return [(heads.start + g * n, heads.start + (g + 1) * n) for g in range(groups)]


def group_views(kv: torch.Tensor, heads: range) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """Each head group of ``kv``, which holds the model's KV heads ``heads``, with the range of
    them it holds (what a transport registers as a rank's tensor and head range)."""
    groups = kv_groups_of(kv)
    return list(zip(groups, group_head_ranges(heads, len(groups)), strict=True))


def check_kv_head_groups(groups: int, kv_heads: int) -> None:
    """``kv_heads``: the engine's (a rank's, under tensor parallelism)."""
    if kv_heads % groups:
        raise ValueError(f"--kv-head-groups {groups} must divide the {kv_heads} KV heads each "
                         f"engine (each tensor-parallel rank) holds")


def plane_view(plane: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """What a layer reads and writes of one plane (``kv[layer, K|V]``, as stored): flat
    ``[slots, kv_heads, head_dim]`` rows (a slot is ``block * block_size + offset``), or, heads
    first, ``[blocks, block_size, kv_heads, head_dim]`` (strided: no flat slot view exists)."""
    if heads_first:
        return plane.transpose(1, 2)
    nb, bs, kvh, hd = plane.shape
    return plane.view(nb * bs, kvh, hd)


def as_blocks(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """A layer plane's cache (``plane_view``) as ``[blocks, block_size, kv_heads, head_dim]``."""
    return cache if cache.dim() == 4 else cache.view(-1, block_size, *cache.shape[1:])


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows of ``slots``, ``[len(slots), kv_heads, head_dim]``, either view."""
    if cache.dim() == 3:
        return cache.index_select(0, slots)
    bs = cache.shape[1]
    return cache[slots // bs, slots % bs]
