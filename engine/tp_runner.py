"""Rank 0's model runner of a tensor-parallel replica: before each forward it sends the step to
the other ranks (see :mod:`kvrelay.engine.tensor_parallel`), then runs its own shard and samples.

KV transfer (CPU): every rank's KV tensor is a shared-memory file, which rank 0 maps too
(:attr:`TPModelRunner.rank_kv`), so rank 0's KV connector registers and moves the KV of all
ranks. Rank 0 learns that a layer's K/V are in *every* rank's cache one layer late: when it
writes layer L, each other rank has passed the all-reduce after layer L-1 (so wrote L-1's K/V),
not necessarily L's. So ``save_layer`` hears of layer L-1 then, and ``end_step`` (after the
last all-reduce) sends the rest.

A failure of any rank (dead, stuck past ``tp_timeout_s``, or an error in its step) surfaces here
as :class:`TensorParallelError`; the replica is then unusable and its ranks are stopped.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.kv_cache import group_views
from kvrelay.engine.kv_connector import KVConnector, RankKV, ScheduledSeq
from kvrelay.engine.model_runner import ModelRunner, SampledTokens
from kvrelay.engine.tensor_parallel import (
    Ranks,
    TensorParallelError,
    kv_head_range,
    shared_kv_cache,
    startup_timeout,
    tp_model_config,
    unlink_kv_shm,
    validate_tp,
)

logger = logging.getLogger(__name__)


class TPModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig):
        from kvrelay.engine.models.arch import load_model_config

        validate_tp(load_model_config(config.model.model)[1],
                    config.model.tensor_parallel_size)
        config = tp_model_config(config)
        self.ranks = Ranks(config)
        self._finalizer = weakref.finalize(self, self.ranks.close)
        try:
            super().__init__(config, shard=self.ranks.shard)
            self.check_blocks(startup_timeout(config))
            self.rank_kv = self._map_rank_kv()
        except ValueError:
            self.close()
            raise
        except RuntimeError as e:
            self.ranks.abandon()
            self.close()
            raise self.ranks.error("loading the model", e) from e
        logger.info("tensor parallel: %d ranks (pids %s), %d KV heads per rank",
                    self.ranks.size, self.ranks.pids, self.kv_spec.num_kv_heads)
        self._failed: TensorParallelError | None = None

    def _guarded(self, fn: Callable[..., Any], scheduled: Seq[ScheduledSeq], *args: Any) -> Any:
        if self._failed is not None:
            raise self._failed
        try:
            self.ranks.send_step(scheduled)
            return fn(scheduled, *args)
        except (RuntimeError, OSError) as e:
            if isinstance(e, TensorParallelError):
                raise
            self._failed = self.ranks.error("running a step", e)
            self.ranks.abandon()
            self.close()
            raise self._failed from e

    def _map_rank_kv(self) -> RankKV | None:
        """The other ranks' KV tensors (they exist: ``check_blocks`` ran after every rank
        allocated), then the files go (the mappings stay). Under KV head groups every rank's
        groups, rank after rank, are the transport's ranks."""
        shm = self.ranks.kv_shm
        if not shm:
            return None
        size = self.ranks.size
        kvs = [self.kv, *(shared_kv_cache(shm, r, tuple(self.kv.shape), self.kv_spec.torch_dtype)
                          for r in range(1, size))]
        unlink_kv_shm(shm, size)
        return RankKV.from_views([v for i, kv in enumerate(kvs)
                                  for v in group_views(kv, kv_head_range(self.arch, i, size))],
                                 self.arch.num_kv_heads)

    def run(self, scheduled: Seq[ScheduledSeq], connector: KVConnector | None = None) \
            -> SampledTokens:
        if connector is not None and self.rank_kv is None:
            raise NotImplementedError("KV transfer under tensor parallelism needs CPU KV "
                                      "caches (shared memory between the ranks)")
        return self._guarded(super().run, scheduled, connector)

    def _kv_written_hook(self, connector: KVConnector) -> Callable[[int], None]:
        def lagged(layer: int) -> None:  # see the module docstring
            if layer > 0:
                connector.save_layer(layer - 1)

        return lagged

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        # Forks exist only on a decode engine (a KV connector), which TP does not run yet.
        raise NotImplementedError("copy-on-write of KV blocks under tensor parallelism")

    def logits_for(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
        return self._guarded(super().logits_for, scheduled)

    @property
    def worker_pids(self) -> list[int | None]:
        """Process ids of ranks 1..N-1."""
        return self.ranks.pids

    def close(self) -> None:
        """Stop the other ranks (also at garbage collection and interpreter exit)."""
        self._finalizer()
