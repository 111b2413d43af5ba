"""A decode engine's reservation when the room it needs is partly its own cached prefix: the
matched blocks that are free (cached, unreferenced) are taken from the free list first, so the
room is judged after matching. Found by the multi-round QA benchmark: a reservation that passed
the check before matching failed its allocation after (an AssertionError out of Reserve, which
the router took for a failed worker)."""

from __future__ import annotations

import pytest
from engine_runs import run_one, seeded_prompt

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore, EngineOverloaded

BLOCK = 8


def test_a_reservation_that_does_not_fit_once_its_prefix_is_taken_is_refused(
        demo_model_dir) -> None:
    core = EngineCore(EngineConfig.from_kwargs(demo_model_dir, block_size=BLOCK, num_blocks=48,
                                               max_num_batched_tokens=64, seed=0))
    bm = core.block_manager
    a = seeded_prompt(1, 160)
    run_one(core, "a", a)  # 20 blocks, freed and cached
    held = core.reserve("held", seeded_prompt(2, 190))  # 24 blocks held
    assert bm.num_free_blocks == bm.num_blocks - len(held.block_ids)
    # a's 20 cached blocks plus 5 new ones: 25 blocks, but only 24 are free, 20 of them a's.
    with pytest.raises(EngineOverloaded, match="no KV room"):
        core.reserve("b", a + seeded_prompt(3, 40))
    assert bm.num_free_blocks == bm.num_blocks - len(held.block_ids), "nothing leaked"
    assert "b" not in core.seqs
    # Once the other reservation lets go it fits, finding a's blocks cached.
    core.abort("held", emit=False)
    res = core.reserve("b2", a + seeded_prompt(3, 40))
    assert res.num_cached_tokens == 160
    core.abort("b2", emit=False)
    assert bm.num_free_blocks == bm.num_blocks
