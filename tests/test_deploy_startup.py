"""What a deployed process sets up from its command line before it serves: the locked-memory limit
RDMA needs (kvrelay/cli.py)."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

from kvrelay.cli import raise_memlock_limit


def test_worker_raises_its_memlock_limit_and_warns_beside_rdma_devices(tmp_path: Path,
                                                                     caplog) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lowered = 64 * 1024 if hard == resource.RLIM_INFINITY else min(64 * 1024, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (lowered, hard))
    try:
        with caplog.at_level(logging.WARNING, logger="kvrelay.cli"):
            assert raise_memlock_limit(str(tmp_path / "absent")) == hard
            assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == (hard, hard)
            assert not caplog.records  # no RDMA device: nothing to say
            raise_memlock_limit(str(tmp_path))  # an RDMA device directory exists
        warned = [r.getMessage() for r in caplog.records]
        assert bool(warned) is (hard != resource.RLIM_INFINITY), warned
        assert all("LimitMEMLOCK" in w for w in warned)
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
