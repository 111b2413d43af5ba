"""The KV I/O: one NIXL agent per process moving (layer, K|V, block) regions between KV tensors.

The engine's single KV tensor is registered once (DRAM, or VRAM when it lives on CUDA). Under
tensor parallelism each rank's process has one of these over its own KV (its *transport ranks*:
the rank, or its KV head groups), and writes the heads it holds to the peer's agents that hold
them (``staging``; ``rank_agents`` drives ranks 1..N-1 from rank 0). Its
descriptor list has one entry per (layer, kv, block) in tensor order, prepared once locally and
once per peer, so a write is built by index: no per-transfer registration or validation. A
*read* (``read``: a prefix pulled from a peer that holds it, instead of recomputed) uses the
same descriptors the other way round: the peer's regions are the source, ours the destination.

Peers are added from a ``PeerInfo`` that travels over our own control channel (NIXL's listener
thread is off). Re-adding a name with a new incarnation (a restarted peer) replaces the old one.

Progress: NIXL's progress thread is off (with it, UCX's thread polls with a zero timeout and
burns a core even when idle). Progress happens inside our calls: ``write`` (on CPU the UCX CMA
copy runs right there, with the GIL released), ``poll``, ``progress`` and ``get_notifs``. A
*receiver* must call ``get_notifs`` (or ``progress``) every few milliseconds while it expects KV:
a sender's first write to it cannot complete until the receiver's UCX worker answers the
connection handshake. Likewise a *holder* must progress while a peer may read its blocks (an
export open): a read on a fresh connection waits for its answer (``ExportProgress``).

Every call is serialised by one lock (the agent runs with ``NIXL_THREAD_SYNC_NONE``, i.e. UCX in
serialized mode). Failures raise ``KVTransferError``; a dead peer is ``retriable`` and is dropped
from the peer table, so the caller re-adds it (its new ``PeerInfo``) before the next write.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from kvrelay.kv_transfer.descriptors import (
    block_bounds,
    layer_planes,
    plane_block_indices,
    region_descs,
)
from kvrelay.kv_transfer.errors import KVTransferError
from kvrelay.kv_transfer.layout import (
    KVLayout,
    check_compatible,
    check_kv_tensors,
    head_runs,
)
from kvrelay.kv_transfer.messages import PeerInfo, RankAgent
from kvrelay.kv_transfer.staging import Stager, repack_note
from kvrelay.kv_transfer.transport_types import (  # WriteHandle, Notification: from here too
    Notification,
    PeerAgent,
    PreparedPeer,
    WriteHandle,
    mem_type,
)

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
try:
    import nixl._bindings as _nb
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as e:  # no silent fallback: a disaggregated worker cannot run without it
    raise ImportError(
        f"kvrelay.kv_transfer needs the NIXL Python package to move KV between workers ({e}). "
        "Install it with `pip install nixl` (the wheel bundles UCX), or run the engine in the "
        "aggregated role (no KV transfer).") from e

logger = logging.getLogger(__name__)

# The module a fork server imports to run ``preload_ucx`` (its import is the side effect).
UCX_PRELOAD_MODULE = "kvrelay.kv_transfer.ucx_preload"


def preload_ucx() -> bool:
    """Load NIXL's UCX plugin (and UCX with it) now, in a process that will fork the ones
    that make agents: a fork server (``kvrelay.fork_preload``, a TP replica's rank server).

    UCX's library constructor (``ucs_init``) calibrates the CPU's clock in a busy loop: ~0.4 CPU
    s, 90 % of making the first agent in a process (then ~0.04 s; 2-vCPU Zen 3, nixl 1.5.1).
    Loaded before the fork, the forks inherit the calibrated library, and NIXL's own dlopen of
    the plugin finds it loaded. Nothing else runs at load (no context, no thread: UCX starts
    those with the first agent), so the fork is clean. Returns whether the plugin was found
    beside the loaded ``libnixl`` (``NIXL_PLUGIN_DIR`` where set)."""
    import ctypes

    plugin_dir = os.environ.get("NIXL_PLUGIN_DIR")
    if not plugin_dir:  # NIXL's default: ``plugins`` beside the libnixl its bindings loaded
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith("/libnixl.so")}
        if not paths:
            return False
        plugin_dir = os.path.join(os.path.dirname(paths.pop()), "plugins")
    plugin = os.path.join(plugin_dir, "libplugin_UCX.so")
    if not os.path.exists(plugin):
        logger.debug("no UCX plugin at %s: not preloaded", plugin)
        return False
    ctypes.CDLL(plugin)  # RTLD_LOCAL, as NIXL opens it; its dlopen then finds this one
    return True


# NIXL errors after which the same request may succeed elsewhere or after a reconnect.
_RETRIABLE_NIXL = tuple(
    getattr(_nb, n) for n in ("nixlRemoteDisconnectError", "nixlNotFoundError",
                              "nixlCancelledError", "nixlBackendError", "nixlUnknownError",
                              "nixlNotPostedError") if hasattr(_nb, n))
_NIXL_ERRORS = tuple(getattr(_nb, n) for n in dir(_nb)
                     if n.startswith("nixl") and n.endswith("Error"))
_DISCONNECT = getattr(_nb, "nixlRemoteDisconnectError", ())


def _verb(handle: WriteHandle) -> str:
    return "a read from" if handle.op == "read" else "a write to"


def _what(handle: WriteHandle) -> str:
    return f"{_verb(handle)} {handle.peer}"


class NixlTransport:
    def __init__(self, agent_name: str, kv: torch.Tensor, layout: KVLayout, *,
                 write_timeout_s: float = 10.0, num_threads: int = 0,
                 rank_kvs: Sequence[torch.Tensor] = (), slots: Sequence[int] | None = None,
                 staging_bytes: int = 64 << 20) -> None:
        """``kv`` and ``rank_kvs`` are the KV of ``slots``, the transport ranks of ``layout`` this
        process holds (default: all of them; see ``layout.head_ranges``): under tensor
        parallelism a rank's own, with KV head groups one per group. ``staging_bytes``: the
        buffer writes to a peer of another head split are packed in (allocated on the first
        such write; see ``staging``)."""
        tensors = [kv, *rank_kvs]
        slots = tuple(range(len(tensors)) if slots is None else slots)
        check_kv_tensors(layout, tensors, slots)
        if write_timeout_s <= 0:
            raise ValueError(f"write_timeout_s must be positive, got {write_timeout_s}")
        self.name = agent_name
        self.layout = layout
        self.write_timeout_s = write_timeout_s
        self._block_bytes = layout.block_bytes
        self.incarnation = uuid.uuid4().hex
        self._kv = kv
        self.slots = slots
        self._slot_kvs = dict(zip(slots, tensors, strict=True))
        self._lock = threading.RLock()
        self._peers: dict[str, PreparedPeer] = {}
        # Written under the lock, read without it: the engine thread asks for incarnations
        # while the I/O thread may hold the lock for a long copy.
        self._incarnations: dict[str, str] = {}
        self._notifs: list[Notification] = []
        self._closed = False
        self._device_id = max(kv.get_device(), 0)
        self._mem = mem_type(layout.device_kind)
        self._agent = nixl_agent(agent_name, nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
            num_threads=num_threads))
        if "UCX" not in self._agent.backends:
            raise KVTransferError("NIXL has no UCX backend here (plugin missing): reinstall nixl",
                                  retriable=False)
        self._reg = self._agent.register_memory(tensors if len(tensors) > 1 else kv)
        self._stager = Stager(self._agent, staging_bytes, kv.dtype, self._device_id, self._mem)
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", region_descs(kv.data_ptr(), layout, self._device_id), self._mem)
        logger.info("NIXL agent %s up: %s KV, %d blocks x %d B x %d planes (incarnation %s)",
                    agent_name, self._mem, layout.num_blocks, layout.block_bytes,
                    layout.num_layers * layout.planes, self.incarnation[:8])

    @property
    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            return self._agent.get_agent_metadata()

    @property
    def slot_addresses(self) -> dict[int, int]:
        """Each of our transport ranks' KV address (in this process)."""
        return {slot: t.data_ptr() for slot, t in self._slot_kvs.items()}

    # -- identity ------------------------------------------------------------------------------
    def peer_info(self, ranks: Sequence[tuple[RankAgent, dict[int, int]]] = ()) -> PeerInfo:
        """Our endpoint; under tensor parallelism (we are rank 0's agent) with ``ranks``: the
        other ranks' agents and their transport ranks' KV addresses (``rank_agents``)."""
        with self._lock:
            self._check_open()
            md = self._agent.get_agent_metadata()
        addrs = dict(self.slot_addresses)
        for _, theirs in ranks:
            addrs.update(theirs)
        if sorted(addrs) != list(range(self.layout.tp_size)):
            raise KVTransferError(f"agent {self.name}'s endpoint lacks transport ranks: has "
                                  f"{sorted(addrs)} of {self.layout.tp_size}", retriable=False)
        return PeerInfo(self.name, md, self.layout, self._kv.data_ptr(), self._device_id,
                        self.incarnation, tuple(addrs[s] for s in range(self.layout.tp_size)),
                        tuple(a for a, _ in ranks))

    # -- peers ---------------------------------------------------------------------------------
    def add_peer(self, info: PeerInfo) -> bool:
        """Connect to ``info``'s agent; True if it was (re)added, False if already current."""
        if info.agent_name == self.name:
            raise KVTransferError(f"peer name {info.agent_name!r} is our own agent name: give "
                                  "every worker a unique agent name", retriable=False)
        check_compatible(self.layout, info.layout, peer=info.agent_name)
        with self._lock:
            self._check_open()
            cur = self._peers.get(info.agent_name)
            if cur is not None and cur.info.incarnation == info.incarnation:
                return False
            if cur is not None:
                logger.info("peer %s restarted (incarnation %s -> %s): reconnecting",
                            info.agent_name, cur.info.incarnation[:8], info.incarnation[:8])
            self._drop(info.agent_name)
            try:
                loaded = self._agent.add_remote_agent(info.agent_metadata)
            except _NIXL_ERRORS:
                # NIXL may still hold metadata of an earlier incarnation under this name.
                self._agent.remove_remote_agent(info.agent_name)
                loaded = self._load(info)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != info.agent_name:
                self._agent.remove_remote_agent(loaded)
                raise KVTransferError(f"PeerInfo names agent {info.agent_name!r} but its NIXL "
                                      f"metadata is agent {loaded!r}", retriable=False)
            try:
                dlist = self._agent.prep_xfer_dlist(
                    info.agent_name, region_descs(info.base_address, info.layout, info.device_id),
                    mem_type(info.layout.device_kind))
            except _NIXL_ERRORS as e:
                self._agent.remove_remote_agent(info.agent_name)
                raise self._error(e, info.agent_name, "preparing descriptors of") from e
            runs, agents, read_runs = None, None, None
            if self.layout.tp_size > 1 or info.layout.tp_size > 1:
                runs = [r for r in head_runs(self.layout, info.layout) if r.src in self.slots]
                read_runs = [r for r in head_runs(info.layout, self.layout)
                             if r.dst in self.slots]
                try:
                    agents = self._prep_agents(info, {r.dst for r in runs}
                                               | {r.src for r in read_runs})
                except (KVTransferError, *_NIXL_ERRORS) as e:
                    dlist.release()  # type: ignore[attr-defined]
                    self._agent.remove_remote_agent(info.agent_name)
                    if isinstance(e, KVTransferError):
                        raise
                    raise self._error(e, info.agent_name, "preparing descriptors of") from e
            self._peers[info.agent_name] = PreparedPeer(info, dlist, runs, agents, read_runs)
            self._incarnations[info.agent_name] = info.incarnation
        note = repack_note(self.layout, info.layout, runs)
        logger.log(logging.WARNING if note else logging.INFO, "added KV peer %s (%d blocks)%s",
                   info.agent_name, info.layout.num_blocks, note)
        return True

    def _prep_agents(self, info: PeerInfo, slots: set[int]) -> dict[str, PeerAgent]:
        """Load the metadata of each of ``info``'s agents that holds one of ``slots`` (its main
        one is loaded already) and prepare its ranks' regions."""
        by_agent: dict[str, tuple[list[int], int]] = {}
        for slot in sorted(slots):
            name, device = info.agent_of(slot)
            by_agent.setdefault(name, ([], device))[0].append(slot)
        out: dict[str, PeerAgent] = {}
        try:
            for name, (held, device) in by_agent.items():
                if name != info.agent_name:
                    self._agent.remove_remote_agent(name)  # an earlier incarnation's, if any
                    self._agent.add_remote_agent(info.agent_metadata_of(name))
                dl = self._stager.prep_agent(info, name, held, device)
                out[name] = PeerAgent(name, tuple(held), dl, device)
        except _NIXL_ERRORS as e:
            for a in out.values():
                a.dlist.release()  # type: ignore[attr-defined]
            for name in by_agent:
                if name != info.agent_name:
                    self._agent.remove_remote_agent(name)
            raise self._error(e, info.agent_name, "loading the rank agents of") from e
        return out

    def _load(self, info: PeerInfo) -> str:
        try:
            return self._agent.add_remote_agent(info.agent_metadata)
        except _NIXL_ERRORS as e:
            raise self._error(e, info.agent_name, "loading metadata of") from e

    def has_peer(self, name: str) -> bool:
        return name in self._incarnations

    def peer_incarnation(self, name: str) -> str | None:
        """Lock-free: never waits for a write in progress."""
        return self._incarnations.get(name)

    def evict_peer(self, name: str) -> bool:
        """Forget a peer (its writes in flight fail); True if it was known."""
        with self._lock:
            known = name in self._peers
            self._drop(name)
        if known:
            logger.info("evicted KV peer %s", name)
        return known

    def _drop(self, name: str) -> None:
        self._incarnations.pop(name, None)
        p = self._peers.pop(name, None)
        if p is None:
            return
        agents = list((p.agents or {}).values())
        for dl in (p.dlist, *(a.dlist for a in agents)):
            try:
                dl.release()  # type: ignore[attr-defined]
            except _NIXL_ERRORS as e:
                logger.debug("releasing descriptors of %s: %s", name, e)
        for a in agents:
            if a.name != name:
                self._agent.remove_remote_agent(a.name)
        self._agent.remove_remote_agent(name)  # returns a status, never raises

    # -- writes --------------------------------------------------------------------------------
    def write(self, peer: str, layers: int | Sequence[int] | None,
              local_block_ids: Sequence[int], remote_block_ids: Sequence[int], *,
              incarnation: str | None = None) -> WriteHandle:
        """Post a WRITE of K and V of ``layers`` (None: all) for each block pair. With
        ``incarnation``, refuse if the peer restarted since (its block ids changed owners)."""
        nl = self.layout.num_layers
        if isinstance(layers, int):
            layers = (layers,)
        elif layers is None:
            layers = range(nl)
        if not len(layers) or min(layers) < 0 or max(layers) >= nl:
            raise KVTransferError(f"layers {list(layers)} out of range [0, {nl})", retriable=False)
        if len(local_block_ids) != len(remote_block_ids) or not len(local_block_ids):
            raise KVTransferError(f"need equally many local and remote blocks, got "
                                  f"{len(local_block_ids)} and {len(remote_block_ids)}",
                                  retriable=False)
        planes = layer_planes(layers, self.layout.planes)
        with self._lock:
            p = self._peer(peer, incarnation)
            nb_local, nb_remote = self.layout.num_blocks, p.info.layout.num_blocks
            lo, hi = block_bounds(local_block_ids)
            rlo, rhi = block_bounds(remote_block_ids)
            if lo < 0 or hi >= nb_local or rlo < 0 or rhi >= nb_remote:
                raise KVTransferError(
                    f"block ids out of range: local {lo}..{hi} of {nb_local}, "
                    f"remote {rlo}..{rhi} of {nb_remote} at {peer}", retriable=False, peer=peer)
            staged: int | None = None
            try:
                if p.runs is None:
                    lidx = plane_block_indices(planes, local_block_ids, nb_local)
                    ridx = plane_block_indices(planes, remote_block_ids, nb_remote)
                    nbytes = len(lidx) * self._block_bytes
                    xfers = [self._agent.make_prepped_xfer("WRITE", self._local, lidx, p.dlist,
                                                           ridx)]
                else:  # several ranks: rank to rank, staged or per token (``Stager.write``)
                    xfers, nbytes, staged = self._stager.write(
                        p, self._slot_kvs, self.layout, planes, local_block_ids,
                        remote_block_ids)
            except _NIXL_ERRORS as e:
                raise self._failed(e, peer, "building a write to") from e
            handle = WriteHandle(peer, nbytes, xfers, time.monotonic() + self.write_timeout_s,
                                 staged)
            return self._post(handle, "a write to")

    # -- reads (prefix pull) ----------------------------------------------------------------------
    def read(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             *, incarnation: str | None = None, timeout_s: float | None = None,
             layers: Sequence[int] | None = None) -> WriteHandle:
        """Post a READ of every layer's K and V (``layers``: only those; under the hybrid KV
        layout, slots of pages) of ``peer``'s blocks ``remote_block_ids[i]`` into our
        ``local_block_ids[i]`` (a prefix the peer holds, pulled instead of recomputed);
        ``poll``/``wait`` the handle as a write's. With ``incarnation``, refuse if the peer
        restarted since it named those blocks. ``timeout_s``: the handle's deadline (default the
        write timeout). Under tensor parallelism each of our transport ranks reads its heads
        from the peer's ranks that hold them (``Stager.read``)."""
        if len(local_block_ids) != len(remote_block_ids) or not len(local_block_ids):
            raise KVTransferError(f"need equally many local and remote blocks, got "
                                  f"{len(local_block_ids)} and {len(remote_block_ids)}",
                                  retriable=False)
        if timeout_s is not None and timeout_s <= 0:
            raise KVTransferError(f"no time left to read from {peer}", retriable=True, peer=peer)
        planes = range(self.layout.num_layers * self.layout.planes) if layers is None \
            else layer_planes(layers, self.layout.planes)
        with self._lock:
            p = self._peer(peer, incarnation)
            nb_local, nb_remote = self.layout.num_blocks, p.info.layout.num_blocks
            lo, hi = block_bounds(local_block_ids)
            rlo, rhi = block_bounds(remote_block_ids)
            if lo < 0 or hi >= nb_local or rlo < 0 or rhi >= nb_remote:
                raise KVTransferError(
                    f"block ids out of range: local {lo}..{hi} of {nb_local}, "
                    f"remote {rlo}..{rhi} of {nb_remote} at {peer}", retriable=False, peer=peer)
            try:
                if p.read_runs is None:
                    lidx = plane_block_indices(planes, local_block_ids, nb_local)
                    ridx = plane_block_indices(planes, remote_block_ids, nb_remote)
                    # READ: the local side is the destination, the remote side the source.
                    xfers = [self._agent.make_prepped_xfer("READ", self._local, lidx, p.dlist,
                                                           ridx)]
                    nbytes = len(lidx) * self._block_bytes
                else:  # several ranks: each of ours from the peer's that hold its heads
                    xfers, nbytes = self._stager.read(p, self._slot_kvs, self.layout,
                                                      list(planes), local_block_ids,
                                                      remote_block_ids)
            except _NIXL_ERRORS as e:
                raise self._failed(e, peer, "building a read from") from e
            timeout = self.write_timeout_s if timeout_s is None else timeout_s
            handle = WriteHandle(peer, nbytes, xfers, time.monotonic() + timeout, op="read")
            return self._post(handle, "a read from")

    def _post(self, handle: WriteHandle, what: str) -> WriteHandle:
        """Post ``handle``'s prepared transfers (under the lock); a refusal or a failure to post
        releases them and raises. ``what``: "a write to" / "a read from", for the messages."""
        self._advance(handle, self._agent.transfer, f"posting {what}",
                      f"NIXL refused {what} {handle.peer}")
        return handle

    def _advance(self, handle: WriteHandle, call: Any, doing: str, refused: str) -> bool:
        """Apply ``call`` (NIXL's ``transfer`` or ``check_xfer_state``) to each of ``handle``'s
        transfers not yet done, releasing those done; True once none is left. A failure
        finishes the handle (every transfer released) and raises."""
        pending = []
        for xfer in handle._xfer:
            try:
                state = call(xfer)
            except _NIXL_ERRORS as e:
                self._finish(handle)
                raise self._failed(e, handle.peer, doing) from e
            if state == "ERR":
                self._finish(handle)
                raise KVTransferError(refused, retriable=True, peer=handle.peer)
            if state == "DONE":
                self._release(xfer)
            else:
                pending.append(xfer)
        handle._xfer = pending
        if not pending:
            self._finish(handle)
        return not pending

    def poll(self, handle: WriteHandle) -> bool:
        """True once the data is at the peer (remote completion: NIXL flushes the endpoint),
        or, for a read, here."""
        if handle.done:
            return True
        what = _what(handle)
        with self._lock:
            if self._advance(handle, self._agent.check_xfer_state,
                             f"completing {_verb(handle)}", f"{what} failed"):
                return True
            if time.monotonic() >= handle.deadline:
                self._finish(handle)
                raise KVTransferError(
                    f"{what} did not complete in {handle.deadline - handle.posted_at:.3g} s "
                    "(peer stuck, or its engine loop is not polling for KV)", retriable=True,
                    peer=handle.peer)
            return False

    def wait(self, handle: WriteHandle, timeout: float | None = None) -> None:
        """Poll until done, sleeping between polls (tests, benchmarks, simple callers)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-5
        while not self.poll(handle):
            if deadline is not None and time.monotonic() >= deadline:
                self.cancel(handle)
                raise KVTransferError(f"{_what(handle)} not done in {timeout:g} s",
                                      retriable=True, peer=handle.peer)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def cancel(self, handle: WriteHandle) -> None:
        with self._lock:
            self._finish(handle)

    def _finish(self, handle: WriteHandle) -> None:
        for xfer in handle._xfer:
            self._release(xfer)
        handle._xfer = []
        if handle.staging is not None:
            self._stager.free(handle.staging)
            handle.staging = None
        handle.done = True

    def _release(self, xfer: object) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except _NIXL_ERRORS as e:  # an active handle NIXL could not cancel: it keeps it
            logger.debug("releasing a transfer handle: %s", e)

    # -- notifications -------------------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes, *, incarnation: str | None = None) -> None:
        """Send ``msg`` to ``peer``. Call only after its writes are done (``poll`` True): a
        standalone notification is not ordered after earlier writes."""
        with self._lock:
            self._peer(peer, incarnation)
            try:
                self._agent.send_notif(peer, msg)
            except _NIXL_ERRORS as e:
                raise self._failed(e, peer, "notifying") from e
            self._pull_notifs()  # progress: lets UCX push the message out now

    def progress(self) -> None:
        """Drive UCX (connection handshakes, queued messages); buffers incoming notifications."""
        with self._lock:
            if not self._closed:
                self._pull_notifs()

    def get_notifs(self) -> list[Notification]:
        with self._lock:
            if not self._closed:
                self._pull_notifs()
            out, self._notifs = self._notifs, []
        return out

    def _pull_notifs(self) -> None:
        for peer, msgs in self._agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            self._notifs.extend(Notification(name, bytes(m)) for m in msgs)

    def _peer(self, name: str, incarnation: str | None) -> PreparedPeer:
        self._check_open()
        p = self._peers.get(name)
        if p is None:
            raise KVTransferError(f"unknown KV peer {name!r}: add_peer() its PeerInfo first "
                                  "(peers are dropped after a failure)", retriable=True,
                                  peer=name)
        if incarnation is not None and p.info.incarnation != incarnation:
            raise KVTransferError(f"KV peer {name} restarted since the request's blocks were "
                                  f"reserved (incarnation {incarnation[:8]} is gone): reserve "
                                  "again", retriable=True, peer=name)
        return p

    # -- errors / lifecycle --------------------------------------------------------------------
    def _error(self, e: BaseException, peer: str, doing: str) -> KVTransferError:
        retriable = isinstance(e, _RETRIABLE_NIXL)
        return KVTransferError(f"NIXL failed {doing} {peer}: {type(e).__name__}: {e}",
                               retriable=retriable, peer=peer)

    def _failed(self, e: BaseException, peer: str, doing: str) -> KVTransferError:
        if _DISCONNECT and isinstance(e, _DISCONNECT):
            # NIXL already invalidated it; drop our side so a restarted peer is re-added fresh.
            self._drop(peer)
            return KVTransferError(f"KV peer {peer} disconnected while {doing} it (process died "
                                   "or restarted): re-add its PeerInfo and retry", retriable=True,
                                   peer=peer)
        return self._error(e, peer, doing)

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"NIXL transport {self.name} is closed", retriable=False)

    def close(self) -> None:
        """Drop every peer, deregister the KV tensor. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name in list(self._peers):
                self._drop(name)
            try:
                self._local.release()
                self._agent.deregister_memory(self._reg)
                self._stager.close()
            except _NIXL_ERRORS as e:
                logger.warning("closing NIXL agent %s: %s", self.name, e)
        logger.info("NIXL agent %s closed", self.name)
