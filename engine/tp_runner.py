"""Rank 0's model runner of a tensor-parallel replica: before each forward it sends the step to
the other ranks (see :mod:`kvrelay.engine.tensor_parallel`), then runs its own shard and samples.

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
from kvrelay.engine.kv_connector import KVConnector, ScheduledSeq
from kvrelay.engine.model_runner import ModelRunner, SampledTokens
from kvrelay.engine.tensor_parallel import (
    Ranks,
    TensorParallelError,
    tp_model_config,
    validate_tp,
)

logger = logging.getLogger(__name__)


class TPModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig):
        from kvrelay.engine.models.arch import arch_from_hf_config, load_hf_config

        validate_tp(arch_from_hf_config(load_hf_config(config.model.model)),
                    config.model.tensor_parallel_size)
        config = tp_model_config(config)
        self.ranks = Ranks(config)
        self._finalizer = weakref.finalize(self, self.ranks.close)
        try:
            super().__init__(config, shard=self.ranks.shard)
            self.check_blocks()
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

    def run(self, scheduled: Seq[ScheduledSeq], connector: KVConnector | None = None) \
            -> SampledTokens:
        if connector is not None:
            raise NotImplementedError("KV transfer is not supported under tensor parallelism yet")
        return self._guarded(super().run, scheduled, None)

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
