"""Where a prompt's prefix could be pulled from, and what a pull costs: shared by the routing
cost model (which prefill worker to choose, counting what each could pull) and by
``prefix_pull`` (whether the chosen one pulls, and from whom).

A source is any other usable prefill or decode worker holding more leading blocks of the prompt
than the reader: the decode worker that generated the previous turn (P<-D: it holds the
history's answer, which no prefill worker ever computed) or another prefill worker (P<-P). The
one holding the most wins; on a tie a prefill worker, whose lending takes nothing from a decode
batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.router.estimators import ClusterPerf
from kvrelay.router.registry import WorkerRegistry
from kvrelay.router.worker_state import WorkerState

SOURCE_ROLES = ("prefill", "decode")  # role=both workers have no NIXL agent to lend from


def best_source(registry: WorkerRegistry, reader: WorkerState, hashes: Sequence[int],
                own: int, now: float) -> tuple[int, WorkerState] | None:
    """The worker other than ``reader`` holding the most leading blocks of ``hashes`` (more than
    ``own``), and how many; None where none holds more."""
    bs = reader.identity.block_size
    best: tuple[int, WorkerState] | None = None
    for role in SOURCE_ROLES:  # prefill first: it wins ties
        for w in registry.alive(role):
            if w is reader or w.identity.block_size != bs:
                continue
            n = w.cached_prefix(hashes, now).blocks
            if n > own and (best is None or n > best[0]):
                best = (n, w)
    return best


def pull_seconds(perf: ClusterPerf, blocks: int) -> float | None:
    """Predicted seconds to pull ``blocks``; None until a block's bytes are known."""
    if blocks <= 0:
        return 0.0
    if not perf.block_bytes:
        return None
    return perf.pull.predict(blocks * perf.block_bytes / 2.0**20)
