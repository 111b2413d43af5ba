"""One file per slot of the disk tier, self-describing and checked on every read.

A file is a header and the block's bytes (every layer, K and V: the host slot's layout)::

    magic "KVRT" | version u16 | header length u16 | layout fingerprint (16 bytes)
    | block hash u64 | parent hash u64 | token count u32 | payload length u64 | crc32 u32
    | token ids (i64 each) | payload

A read accepts the file only when every field matches what the reader expects (the layout it
was written under: model, KV shape and dtype, block size, hash scheme; the block's chain hash,
parent and tokens) and the payload's CRC-32 does: a truncated, corrupted or foreign file is a
miss (the request recomputes), never wrong KV. Writes go to a temporary name and are renamed
into place, so a crash mid-write leaves no file that looks complete.

By default a tier's files live as long as its process: they are removed at start (an earlier
process's index died with it) and at close. Kept (``--kv-offload-keep``), they outlive it: a
process starting on the directory reads every file's header (``found``) and takes the blocks
written under its own layout back into its index, so a restarted worker, or one replacing it on
the same host, starts with the tier warm. On ``/dev/shm`` the tier is then a shared-memory one
that survives the worker process.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import zlib
from array import array
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAGIC = b"KVRT"
VERSION = 1
_HEAD = struct.Struct("<4sHH16sQQIQI")
SUFFIX = ".kvblk"


class DiskReadError(Exception):
    """A tier file that is missing, truncated, corrupted or written for another block."""


def layout_fingerprint(description: str) -> bytes:
    return hashlib.blake2b(description.encode(), digest_size=16).digest()


def claim_directory(root: Path, limit: int = 4096) -> tuple[Path, int]:
    """A subdirectory ``tier-N`` of ``root`` that no live process holds, locked for this one
    (an ``flock`` released when the process ends, however it ends): workers on one host may
    share ``--kv-offload-dir``. Returns it and the lock's file descriptor."""
    for n in range(limit):
        d = root / f"tier-{n}"
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return d, fd
    raise RuntimeError(f"every one of {limit} tier directories under {root} is in use")


class DiskFiles:
    def __init__(self, directory: str | os.PathLike[str], fingerprint: bytes,
                 keep: bool = False):
        self.dir, self._lock = claim_directory(Path(directory))
        self.fingerprint = fingerprint
        self.keep = keep
        # Blocks an earlier process left, written under this layout: (slot, hash, parent hash,
        # token ids). Every other file of this tier's naming is removed (a temporary one, a
        # foreign layout's, or all of them when not keeping); nothing else in the directory.
        self.found: list[tuple[int, int, int, tuple[int, ...]]] = []
        for p in self.dir.glob(f"slot-*{SUFFIX}*"):
            header = self._header(p) if keep and p.suffix == SUFFIX else None
            if header is None:
                p.unlink(missing_ok=True)
            else:
                self.found.append(header)
        self.found.sort()
        logger.info("disk tier in %s%s", self.dir,
                    f" ({len(self.found)} blocks kept)" if keep else "")

    def _header(self, path: Path) -> tuple[int, int, int, tuple[int, ...]] | None:
        """The block a kept file holds, if it is a complete file of this layout (its payload's
        CRC is checked when it is read, as always)."""
        try:
            slot = int(path.name[len("slot-"):-len(SUFFIX)])
            with open(path, "rb") as f:
                magic, version, head_len, fp, h, parent, n_tok, n_bytes, _ = _HEAD.unpack(
                    f.read(_HEAD.size))
                if (magic, version, fp) != (MAGIC, VERSION, self.fingerprint) \
                        or head_len != _HEAD.size + 8 * n_tok:
                    return None
                tokens = array("q")
                tokens.frombytes(f.read(8 * n_tok))
            if os.path.getsize(path) != head_len + n_bytes:
                return None
        except (OSError, ValueError, struct.error):
            return None
        return slot, h, parent, tuple(tokens)

    def close(self) -> None:
        """Remove this tier's files (unless kept) and give its directory up."""
        for p in self.dir.glob(f"slot-*{SUFFIX}*"):
            if not self.keep or p.suffix != SUFFIX:
                p.unlink(missing_ok=True)
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def path(self, slot: int) -> Path:
        return self.dir / f"slot-{slot:07d}{SUFFIX}"

    def write(self, slot: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...],
              payload: torch.Tensor) -> int:
        """Write one block's bytes (``payload``: a contiguous CPU tensor); returns bytes."""
        data = memoryview(payload.view(torch.uint8).reshape(-1).numpy())
        tokens = array("q", token_ids).tobytes()
        head = _HEAD.pack(MAGIC, VERSION, _HEAD.size + len(tokens), self.fingerprint,
                          block_hash, parent_hash, len(token_ids), len(data), zlib.crc32(data))
        final = self.path(slot)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(tokens)
            f.write(data)
        os.replace(tmp, final)
        return len(head) + len(tokens) + len(data)

    def read(self, slot: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...],
             into: torch.Tensor) -> int:
        """Read the block written to ``slot`` into ``into`` (a contiguous CPU tensor of the
        payload's size); raises DiskReadError unless it is exactly that block, complete."""
        buf = memoryview(into.view(torch.uint8).reshape(-1).numpy())
        try:
            with open(self.path(slot), "rb") as f:
                head = f.read(_HEAD.size)
                if len(head) != _HEAD.size:
                    raise DiskReadError("truncated header")
                magic, version, head_len, fp, h, parent, n_tok, n_bytes, crc = _HEAD.unpack(head)
                if magic != MAGIC or version != VERSION:
                    raise DiskReadError(f"not a version-{VERSION} tier file")
                if fp != self.fingerprint:
                    raise DiskReadError("written under another KV layout")
                if (h, parent, n_tok) != (block_hash, parent_hash, len(token_ids)) \
                        or head_len != _HEAD.size + 8 * n_tok:
                    raise DiskReadError("holds another block")
                if n_bytes != len(buf):
                    raise DiskReadError(f"payload of {n_bytes} bytes, expected {len(buf)}")
                tokens = f.read(8 * n_tok)
                if array("q", token_ids).tobytes() != tokens:
                    raise DiskReadError("holds other tokens")
                got = f.readinto(buf)
                if got != n_bytes:
                    raise DiskReadError(f"truncated payload ({got} of {n_bytes} bytes)")
                if zlib.crc32(buf) != crc:
                    raise DiskReadError("payload checksum mismatch")
        except OSError as e:
            raise DiskReadError(str(e)) from e
        return _HEAD.size + 8 * n_tok + n_bytes

    def remove(self, slot: int) -> None:
        self.path(slot).unlink(missing_ok=True)
