"""The disk tier's blocks: one file, a fixed-size record per slot, each checked on every read.

A record is a header, the block's token ids and its bytes (every layer, K and V: the host slot's
layout), the bytes page-aligned at a fixed place in the record::

    magic "KVRT" | version u16 | header length u16 | layout fingerprint (16 bytes)
    | block hash u64 | parent hash u64 | token count u32 | payload length u64
    | payload crc32 u32 | header crc32 u32 (over the fields before it and the token ids)
    | token ids (i64 each) | ... | payload

A read accepts a record only when every field matches what the reader expects (the layout it
was written under: model, KV shape and dtype, block size, hash scheme; the block's chain hash,
parent and tokens) and both CRC-32s do: a torn, truncated, corrupted or foreign record is a miss
(the request recomputes), never wrong KV. A write puts the bytes first and the header after, in
place; a crash between them leaves a header whose payload CRC the bytes do not match.

One file, written in place, and not a file per block: creating a file, writing it under a
temporary name and renaming it over the slot's old one cost ~1.0 ms of CPU a block of the ~150M
model (590 KiB; measured on a 2-core Zen 3), and positional writes into a file sized once cost
~0.15 ms, the CRC ~0.2 ms more with zlib's CRC-32 (2.2-3.2 GB/s), ~0.05 ms with zlib-ng's
(the same CRC, folded with carry-less multiplies: ~12 GB/s; zlib's where zlib-ng is missing).
On a host whose cores run the forward, that is what a disk tier takes from decode where no
block comes back.

By default a tier's file lives as long as its process: it is emptied at start (an earlier
process's index died with it) and removed at close. Kept (``--kv-offload-keep``), it outlives
it: a process starting on the directory reads every record's header (``found``) and takes the
blocks written under its own layout back into its index, so a restarted worker, or one
replacing it on the same host, starts with the tier warm. On ``/dev/shm`` the tier is then a
shared-memory one that survives the worker process.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
from array import array
from pathlib import Path

import torch

try:  # zlib's CRC-32, computed ~4-5x faster (both release the GIL for a block)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # no zlib-ng wheel for this platform: the same checksum, slower
    from zlib import crc32

logger = logging.getLogger(__name__)

MAGIC = b"KVRT"
VERSION = 2
_HEAD = struct.Struct("<4sHH16sQQIQI")  # what the header CRC covers, with the token ids
_CRC = struct.Struct("<I")
HEAD_BYTES = _HEAD.size + _CRC.size
PAGE = 4096
SLAB = "blocks.kvt"


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


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


class DiskFiles:
    """The tier's file of ``slots`` records, each for a block of at most ``max_tokens`` token
    ids and exactly ``payload_bytes`` bytes, in a directory of its own under ``directory``."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: bytes, *, slots: int,
                 payload_bytes: int, max_tokens: int, keep: bool = False):
        self.dir, self._lock = claim_directory(Path(directory))
        self.fingerprint = fingerprint
        self.keep = keep
        self.slots, self.payload_bytes, self.max_tokens = slots, payload_bytes, max_tokens
        self.payload_at = _align(HEAD_BYTES + 8 * max_tokens)  # within a record
        self.record_bytes = self.payload_at + _align(payload_bytes)
        self.file = self.dir / SLAB
        # An earlier version's files (one per block) and anything else of this tier's naming.
        for p in self.dir.glob("slot-*"):
            p.unlink(missing_ok=True)
        self._fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o600)
        # Blocks an earlier process left, written under this layout: (slot, hash, parent hash,
        # token ids).
        self.found: list[tuple[int, int, int, tuple[int, ...]]] = []
        if keep:
            self.found = self._scan()
        else:
            os.ftruncate(self._fd, 0)
        # Sparse: a record's disk space is taken when it is first written.
        os.ftruncate(self._fd, slots * self.record_bytes)
        logger.info("disk tier in %s (%d slots of %d bytes)%s", self.file, slots,
                    self.record_bytes, f", {len(self.found)} blocks kept" if keep else "")

    def offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} of a {self.slots}-slot disk tier")
        return slot * self.record_bytes

    def _scan(self) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """The complete records of this layout an earlier process left (their payloads' CRCs
        are checked when they are read, as always)."""
        size = os.fstat(self._fd).st_size
        out = []
        for slot in range(min(self.slots, size // self.record_bytes)):
            head = self._header(slot)
            if head is not None:
                out.append((slot, *head))
        return out

    def _header(self, slot: int) -> tuple[int, int, tuple[int, ...]] | None:
        """(hash, parent hash, token ids) of the record at ``slot``, if its header is one of
        this layout, intact, for a payload of this tier's size."""
        raw = os.pread(self._fd, self.payload_at, self.offset(slot))
        if raw[:4] != MAGIC:  # never written (a hole reads as zeros), or blanked
            return None
        try:
            h, parent, tokens, _, _ = self._parse(raw)
        except DiskReadError:
            return None
        return h, parent, tuple(array("q", tokens))

    def _parse(self, raw: bytes) -> tuple[int, int, bytes, int, int]:
        """A record's header (``raw``: the record's first ``payload_at`` bytes): (hash, parent
        hash, token ids as bytes, payload CRC, header length); raises DiskReadError unless it
        is an intact header of this layout, for a payload of this tier's size."""
        if len(raw) < HEAD_BYTES:
            raise DiskReadError("truncated header")
        magic, version, head_len, fp, h, parent, n_tok, n_bytes, crc = _HEAD.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise DiskReadError(f"not a version-{VERSION} tier record")
        if fp != self.fingerprint:
            raise DiskReadError("written under another KV layout")
        if n_bytes != self.payload_bytes:
            raise DiskReadError(f"payload of {n_bytes} bytes, expected {self.payload_bytes}")
        if n_tok > self.max_tokens or head_len != HEAD_BYTES + 8 * n_tok:
            raise DiskReadError(f"a header of {n_tok} token ids and {head_len} bytes")
        tokens = raw[HEAD_BYTES:head_len]
        if crc32(tokens, crc32(raw[:_HEAD.size])) != _CRC.unpack_from(
                raw, _HEAD.size)[0]:
            raise DiskReadError("header checksum mismatch")
        return h, parent, tokens, crc, head_len

    def close(self) -> None:
        """Close the tier's file (removed unless kept) and give its directory up."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if not self.keep:
                self.file.unlink(missing_ok=True)
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def write(self, slot: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...],
              payload: torch.Tensor) -> int:
        """Write one block's bytes (``payload``: a contiguous CPU tensor of ``payload_bytes``)
        into ``slot``'s record; returns the bytes written."""
        data = memoryview(payload.view(torch.uint8).reshape(-1).numpy())
        if len(data) != self.payload_bytes:
            raise ValueError(f"a payload of {len(data)} bytes for records of "
                             f"{self.payload_bytes}")
        if len(token_ids) > self.max_tokens:
            raise ValueError(f"{len(token_ids)} token ids for records of {self.max_tokens}")
        tokens = array("q", token_ids).tobytes()
        head = _HEAD.pack(MAGIC, VERSION, HEAD_BYTES + len(tokens), self.fingerprint,
                          block_hash, parent_hash, len(token_ids), len(data), crc32(data))
        at = self.offset(slot)
        if os.pwrite(self._fd, data, at + self.payload_at) != len(data):
            raise OSError(f"short write of slot {slot}'s payload")
        record = head + _CRC.pack(crc32(tokens, crc32(head))) + tokens
        if os.pwrite(self._fd, record, at) != len(record):
            raise OSError(f"short write of slot {slot}'s header")
        return len(record) + len(data)

    def read(self, slot: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...],
             into: torch.Tensor) -> int:
        """Read the block written to ``slot`` into ``into`` (a contiguous CPU tensor of the
        payload's size); raises DiskReadError unless it is exactly that block, complete."""
        buf = memoryview(into.view(torch.uint8).reshape(-1).numpy())
        try:
            at = self.offset(slot)
            h, parent, tokens, crc, head_len = self._parse(os.pread(self._fd, self.payload_at,
                                                                    at))
            if (h, parent) != (block_hash, parent_hash):
                raise DiskReadError("holds another block")
            if array("q", token_ids).tobytes() != tokens:
                raise DiskReadError("holds other tokens")
            if len(buf) != self.payload_bytes:
                raise DiskReadError(f"payload of {self.payload_bytes} bytes, expected "
                                    f"{len(buf)}")
            got = os.preadv(self._fd, [buf], at + self.payload_at)
            if got != self.payload_bytes:
                raise DiskReadError(f"truncated payload ({got} of {self.payload_bytes} bytes)")
            if crc32(buf) != crc:
                raise DiskReadError("payload checksum mismatch")
        except OSError as e:
            raise DiskReadError(str(e)) from e
        return head_len + self.payload_bytes

    def remove(self, slot: int) -> None:
        """Blank ``slot``'s header: a kept tier's next process does not take it."""
        os.pwrite(self._fd, bytes(HEAD_BYTES), self.offset(slot))
