"""What the loopback harness's fork server imports before it forks workers
(``kvrelay.local_cluster``): everything ``kvrelay worker`` loads up to its engine, then the heap
frozen.

Freezing matters as much as importing: a worker collects and freezes its heap once it is up
(``common.gc_tuning.settle_after_startup``), and in a fork that collection walked every object
torch and the worker's modules left in the server, ~0.3 CPU s a worker, copying the pages it
touched. Frozen here, they are in the permanent generation before the fork: no collection in
any worker walks them (the pattern the ``gc.freeze`` documentation gives for forking servers).
"""

from __future__ import annotations

import gc

import kvrelay.cli
import kvrelay.engine.tensor_parallel  # a worker's TP ranks fork from it too
import kvrelay.kv_transfer.connector  # NIXL's bindings: imported, no agent made
import kvrelay.kv_transfer.ucx_preload  # UCX loaded: its clock calibration, once for every fork
import kvrelay.worker.process

kvrelay.cli.build_parser()  # what the command line imports lazily (the planner's options)
gc.collect()
gc.freeze()
