"""Keep a process free of torch (the router: DESIGN.md, "What each process may carry").

With torch installed, transformers imports it as soon as its configuration or tokenizer classes
load, although reading a config and tokenizing need none of it. ``forbid_torch()`` marks torch
as absent for the rest of the process (``sys.modules["torch"] = None``): transformers then sees
no torch and loads the same tokenizer and config torch-free, and any other ``import torch`` in
the process fails at once instead of quietly costing hundreds of MiB.

Call it first thing in a process's entry point, never from library code: a process that runs
the engine (a test, a worker) must keep its torch.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def forbid_torch() -> None:
    """Make ``import torch`` fail in this process, and torch look absent to transformers."""
    if sys.modules.get("torch") is not None:
        raise RuntimeError("torch is already imported in this process; forbid_torch() must run "
                           "before anything imports it")
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers announces once that it found no torch; here that is the intent.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logger.debug("torch is forbidden in this process")


def torch_loaded() -> bool:
    """True when torch is imported in this process."""
    return sys.modules.get("torch") is not None
