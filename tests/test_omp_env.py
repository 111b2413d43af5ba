"""common.omp_env: an engine process's OpenMP settings, set before torch loads them."""

from __future__ import annotations

import os
import subprocess
import sys

from kvrelay.common.omp_env import WORKER_OMP_DEFAULTS, apply_worker_omp_defaults


def test_sets_what_is_unset_and_keeps_the_users_value() -> None:
    env: dict[str, str] = {}
    assert apply_worker_omp_defaults(env) == WORKER_OMP_DEFAULTS
    assert env["GOMP_SPINCOUNT"] == "20000"
    mine = {"GOMP_SPINCOUNT": "1000"}
    assert apply_worker_omp_defaults(mine) == {}
    assert mine == {"GOMP_SPINCOUNT": "1000"}


# In a fresh interpreter: the first import of torch reports GOMP_SPINCOUNT as it is then, and
# stops the process (GNU OpenMP reads the variable once, when torch loads it).
_PROBE = """
import os, sys
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("SPIN", os.environ.get("GOMP_SPINCOUNT"), flush=True)
            os._exit(0)
        return None
sys.meta_path.insert(0, Probe())
from kvrelay import cli
cli.main(sys.argv[1:])
"""


def test_worker_command_applies_them_before_torch_loads(demo_model_dir: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "worker", "--role", "both", "--model", demo_model_dir,
         "--router", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=120, env=env, check=False)
    assert "SPIN 20000" in out.stdout, out.stdout + out.stderr[-2000:]
