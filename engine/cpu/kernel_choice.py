"""What ``--linear-kernel auto`` measured, kept for the next engine of the same kind.

The choice between the native panel GEMM and oneDNN (:func:`kvrelay.engine.loader.
choose_linear_kernel`) times both on the model's own linears at load, from 8 rows to a full
prefill step's: a fraction of a second on the ~7M model, longer on larger ones, and on a busy
machine a coin toss between two close kernels, so replicas of one deployment could differ. The
result (the kernel, and the rows up to which ``mixed`` takes the panels) is kept in one small
JSON file per key under the cache directory, beside the native build: the native kernels' build
(its name holds their sources, flags, compiler and CPU), the torch build, the thread count, the
rows a prefill step was timed at (the engine's token budget) and every linear's shape (a
tensor-parallel shard has its own). A later engine of the same key packs only the kept kernel.
Delete ``$KVRELAY_CACHE_DIR/linear_kernel`` to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from kvrelay.engine.cpu import native

logger = logging.getLogger(__name__)


def cache_key(shapes: Sequence[tuple[int, int]], threads: int, prefill_rows: int) -> str:
    text = "|".join([native.library_name(), torch.__version__, str(threads), str(prefill_rows),
                     ";".join(f"{a}x{b}" for a, b in shapes)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _path(key: str) -> Path:
    return native.cache_root() / "linear_kernel" / f"{key}.json"


def load(key: str) -> tuple[str, int] | None:
    """The kernel kept for ``key`` and the rows up to which ``mixed`` takes the panels, or None
    (never measured, or an unreadable file)."""
    try:
        doc = json.loads(_path(key).read_text())
        kernel, panel_rows = doc["kernel"], int(doc["panel_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (kernel, panel_rows) if kernel in ("panels", "onednn", "mixed") else None


def save(key: str, kernel: str, panel_rows: int, measured: dict[str, float]) -> None:
    """Keep ``kernel`` for ``key`` (atomically: concurrent engines may race to write it)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"kernel": kernel, "panel_rows": panel_rows, "measured_ms": measured}, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measure again next time
        logger.debug("could not keep the linear kernel choice in %s: %s", path, e)
