"""Child processes of the GPU transfer tests: a NIXL agent over a KV tensor in VRAM."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import torch

from kvrelay.engine.kv_cache import KVCacheSpec, allocate_kv_cache

POLL_S = 0.002


def cuda_receiver(conn: Connection, name: str, spec: dict[str, Any], model_id: str,
                  device: str) -> None:
    """Answers ("blocks", layer_block_pairs) with those blocks (on the CPU) and reports every
    notification; like a decode worker, it progresses UCX every few ms from its own thread."""
    from kvrelay.kv_transfer.cuda_sync import bind_thread_to
    from kvrelay.kv_transfer.layout import KVLayout
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    dev = torch.device(device)
    bind_thread_to(dev)
    kv_spec = KVCacheSpec(**spec)
    kv = allocate_kv_cache(kv_spec, dev)
    tr = NixlTransport(name, kv, KVLayout.from_spec(kv_spec, model_id, "cuda"))
    conn.send(("info", tr.peer_info().to_bytes()))
    while True:
        for n in tr.get_notifs():
            conn.send(("notif", n.peer, n.msg))
        if conn.poll(POLL_S):
            cmd = conn.recv()
            if cmd[0] == "exit":
                break
            if cmd[0] == "blocks":
                torch.cuda.synchronize(dev)
                conn.send(("blocks", [kv[layer, :, b].cpu() for layer, b in cmd[1]]))
    tr.close()
