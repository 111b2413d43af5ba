"""A P/D handoff under the hybrid KV layout (``engine/hybrid_kv.py``), without NIXL: a prefill
engine's real sender (``kv_transfer/sending.py``) plans its writes, and each write is applied as
a copy into a decode engine's KV tensor at the moment the I/O thread would post it (layer by
layer while the next layer computes, or at the step's end). The decode engine's reservation is
the real one: it holds, of each windowed layer group, only the pages of the blocks its first
decode reads, and names them (``Reservation.page_ids``). What must hold:

- each layer group's pages, and only those the decode reads, are written (its slots, its pages);
- the decode engine, whose other pages hold poison, decodes transformers' greedy tokens;
- every page comes back on both sides, and the decode side's blocks before the window are partial
  (served as a cached prefix only where no window reads them: ``match_prefix``);
- a destination that lacks a page the handoff writes is refused with a clear error, and so is a
  peer whose layout differs (``--hybrid-kv`` on one side only), naming both sides;
- a prefix pull (``prefix_shares.py``): the holder of a finished conversation exports the
  longest prefix a continuation may take, the reader holds and reads only the pages that
  continuation reads (``NixlConnector.read_parts``, applied as copies), and the next turn
  continues from it with transformers' tokens.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_parity import hf_tokens, prompts
from test_sliding_window_kv import _Transport

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.hybrid_blocks import HybridBlockManager
from kvrelay.engine.kv_connector import KVConnector, TransferEvents
from kvrelay.engine.kv_window import block_needs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kv_transfer.config import NixlConnectorConfig
from kvrelay.kv_transfer.layout import IncompatibleKVLayout, KVLayout, check_compatible
from kvrelay.kv_transfer.messages import KVDestination
from kvrelay.kv_transfer.send_tracker import NotifJob
from kvrelay.kv_transfer.sending import Sending
from kvrelay.kv_transfer.transfer_thread import WriteJob

BS = 8
GEN = 12
POISON = 1e30  # finite: torch SDPA gathers whole tables and masks; NaN would poison its sums


class CopyingSender(KVConnector):
    """The prefill side: ``Sending``'s plan, each write copied into ``peer_kv`` when posted."""

    def __init__(self, peer_kv: torch.Tensor, layerwise: str) -> None:
        self.tx = Sending(NixlConnectorConfig("prefill", "model", layerwise=layerwise))
        self.peer_kv = peer_kv
        self.pages_written: dict[int, set[tuple[int, int]]] = {}  # slot -> (local, remote)
        self.kv: torch.Tensor | None = None

    def register_kv_cache(self, kv, spec, ranks=None) -> None:
        self.kv = kv
        self.tx.attach(_Transport(), spec, kv.device)  # type: ignore[arg-type]
        self.tx._io = lambda: self  # type: ignore[method-assign]

    def submit(self, job: object) -> None:  # the I/O thread's, done at once
        assert self.kv is not None
        if isinstance(job, WriteJob):
            for slot in job.layers:
                self.peer_kv[slot][:, job.remote] = self.kv[slot][:, job.local]
                self.pages_written.setdefault(slot, set()).update(zip(job.local, job.remote,
                                                                      strict=True))
            for nj in self.tx._on_write_end(job, None):
                self.submit(nj)
        elif isinstance(job, NotifJob):
            self.tx._on_notif_end(job, None)

    def start_step(self, scheduled) -> None:
        self.tx.start_step(scheduled)

    def wants_layer_hooks(self, scheduled) -> bool:
        return self.tx.wants_layer_hooks(scheduled)

    def save_layer(self, layer: int) -> None:
        self.tx.save_layer(layer)

    def end_step(self) -> None:
        self.tx.end_step()

    def request_finished(self, seq) -> bool:
        return self.tx.finished(seq, seq.kv_transfer_params)

    def take_events(self) -> TransferEvents:
        ev = self.tx.take()
        return TransferEvents(ev.sent + ev.abandoned, [], ev.failed)

    def has_pending(self) -> bool:
        return self.tx.has_pending()


class Arrivals(KVConnector):
    """The decode side: KV is declared arrived by the test (``arrived``)."""

    def __init__(self) -> None:
        self.received: list[str] = []

    def register_kv_cache(self, kv, spec, ranks=None) -> None:
        pass

    def request_finished(self, seq) -> bool:
        return False

    def take_events(self) -> TransferEvents:
        got, self.received = self.received, []
        return TransferEvents([], got, [])

    def has_pending(self) -> bool:
        return bool(self.received)


def core(model_dir: str, connector: KVConnector | None, **kw: object) -> EngineCore:
    opts: dict[str, object] = dict(block_size=BS, num_blocks=64, max_num_batched_tokens=24,
                                   long_prefill_threshold=6, seed=0, hybrid_kv="auto")
    opts.update(kw)
    return EngineCore(EngineConfig.from_kwargs(model_dir, **opts), connector=connector)


def drain(engine: EngineCore) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(1000):
        if not engine.has_unfinished() and not (engine.connector is not None
                                                and engine.connector.has_pending()):
            break
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def pages_by_block(page_ids: tuple[int, ...], groups: int) -> list[tuple[int, ...]]:
    return [page_ids[i:i + groups] for i in range(0, len(page_ids), groups)]


@pytest.mark.parametrize(("name", "backend", "layerwise"), [
    ("gemma3", "auto", "on"),  # 2 local layers (window 24) : 1 global, k=1: 3 groups
    ("gemma3", "sdpa", "off"),
    ("gpt_oss", "auto", "on"),  # alternating window-16 and full layers, sinks
])
def test_a_handoff_writes_each_groups_pages_and_decodes_transformers_tokens(
        hf_model_dir, name: str, backend: str, layerwise: str) -> None:
    model_dir = hf_model_dir(name)
    prompt = prompts(3, (70,))[0]
    want = hf_tokens(model_dir, tuple(prompt), GEN)
    dst = core(model_dir, Arrivals(), attention_backend=backend)
    plan = dst.runner.kv_plan
    assert plan is not None and isinstance(dst.block_manager, HybridBlockManager)
    dst.runner.kv.fill_(POISON)  # a page the handoff does not write must never be read
    free = dst.block_manager.num_free_pages
    res = dst.reserve("r", prompt)
    g = plan.num_groups
    pages = pages_by_block(res.page_ids, g)
    n = -(-len(prompt) // BS)
    assert res.block_ids and len(pages) == n
    # held: every block's full-attention page, a windowed group's only from its window on
    needs = block_needs(0, n, len(prompt), BS)
    for i, block in enumerate(pages):
        for grp, w in enumerate(plan.windows):
            assert (block[grp] >= 0) == (w is None or needs[i] <= w), (i, grp, w)
    held = sum(p >= 0 for p in res.page_ids)
    assert held < g * n and free - dst.block_manager.num_free_pages == held

    sender = CopyingSender(dst.runner.kv, layerwise)
    src = core(model_dir, sender, attention_backend=backend)
    dest = KVDestination("decode", res.block_ids, 0, b"notif", remote_pages=pages)
    src.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                    kv_transfer_params=dest)
    first = drain(src)["r"]
    assert first == want[:1]
    # each slot got exactly its group's held pages, from the prefill side's pages
    for slot_layers in range(plan.k):
        remote = {r for _, r in sender.pages_written.get(slot_layers, set())}
        expect = {block[grp] for grp, members in enumerate(plan.layers)
                  if slot_layers < len(members) for block in pages if block[grp] >= 0}
        assert remote == expect, slot_layers
    assert src.block_manager.num_free_pages == src.block_manager.num_pages  # all back

    dst.connector.received.append("r")  # type: ignore[attr-defined]
    dst.step()  # takes the arrival
    dst.start_decode("r", first[0], SamplingParams(max_tokens=GEN, temperature=0.0,
                                                   ignore_eos=True))
    got = first + drain(dst)["r"]
    assert got == want
    assert dst.block_manager.num_free_pages == dst.block_manager.num_pages


def test_a_follow_up_continues_from_the_handoff_only_where_its_windows_read_whole_pages(
        hf_model_dir) -> None:
    """The decode side's blocks before the window hold only their full-attention pages: a
    prompt that extends the whole first one reuses them (its windowed layers read past them);
    one that ends early would read their missing pages and is not matched that far."""
    model_dir = hf_model_dir("gemma3")
    prompt = prompts(4, (70,))[0]
    dst = core(model_dir, Arrivals())
    res = dst.reserve("r", prompt)
    dst.connector.received.append("r")  # type: ignore[attr-defined]
    dst.step()
    dst.abort("r")
    drain(dst)
    bm = dst.block_manager
    longer = prompt + prompts(5, (30,))[0]
    assert bm.match_prefix(longer, len(longer) - 1).num_blocks == len(prompt) // BS
    assert bm.match_prefix(prompt[:40], 40).num_blocks == 0  # window 24 reads blocks 2-4
    assert len(res.block_ids) == -(-len(prompt) // BS)


def test_a_destination_without_a_page_the_handoff_writes_is_refused(hf_model_dir) -> None:
    from kvrelay.kv_transfer.connector import NixlConnector

    model_dir = hf_model_dir("gemma3")
    dst = core(model_dir, Arrivals())
    prompt = prompts(6, (70,))[0]
    res = dst.reserve("r", prompt)
    kv = NixlConnector(NixlConnectorConfig("prefill", "model"))
    kv._spec = dst.runner.kv_spec  # what register_kv_cache keeps: the arithmetic needs no agent
    n = len(res.block_ids)
    assert kv.destination_pages(res.page_ids, n, 0, len(prompt))
    last = list(res.page_ids)
    last[-1] = -1  # the last block's page of the last group
    with pytest.raises(ValueError, match="holds no page of layer group"):
        kv.destination_pages(last, n, 0, len(prompt))
    with pytest.raises(ValueError, match="names 3 pages"):
        kv.destination_pages(res.page_ids[:3], n, 0, len(prompt))
    with pytest.raises(ValueError, match="--hybrid-kv auto"):
        kv.destination_pages((), n, 0, len(prompt))


def test_a_peer_of_the_other_layout_is_refused_naming_the_flag(hf_model_dir) -> None:
    model_dir = hf_model_dir("gemma3")
    hybrid = core(model_dir, None).runner.kv_spec
    table = core(model_dir, None, hybrid_kv="off").runner.kv_spec
    a, b = (KVLayout.from_spec(s, "m") for s in (hybrid, table))
    assert a.kv_groups and not b.kv_groups
    with pytest.raises(IncompatibleKVLayout) as e:
        check_compatible(a, b, peer="decode-0")
    msg = str(e.value)
    assert "--hybrid-kv" in msg and "one block table for every layer" in msg \
        and "pages per layer group" in msg and "num_layers" not in msg, msg
    check_compatible(a, KVLayout.from_bytes(a.to_bytes()))  # round trip, compatible


def test_a_pull_reads_the_pages_a_continuation_reads_and_the_next_turn_continues(
        hf_model_dir) -> None:
    from kvrelay.kv_transfer.connector import NixlConnector

    model_dir = hf_model_dir("gemma3")
    holder, reader = core(model_dir, None), core(model_dir, None)
    reader.runner.kv.fill_(POISON)
    turn1 = prompts(7, (70,))[0]
    holder.add_request("a", turn1, SamplingParams(max_tokens=20, temperature=0.0,
                                                  ignore_eos=True))
    answer = drain(holder)["a"]
    turn2 = turn1 + answer + prompts(8, (10,))[0]
    want = hf_tokens(model_dir, tuple(turn2), GEN)
    held = (len(turn1) + len(answer) - 1) // BS * BS  # the holder's full blocks: 88 tokens
    ids, tokens = holder.export_prefix("s", turn2[:held])
    assert tokens == held and len(ids) == held // BS  # the window of its end kept whole
    dst, have = reader.begin_import("t", turn2[:tokens])
    assert have == 0 and len(dst) == len(ids)
    kv = NixlConnector(NixlConnectorConfig("prefill", "model"))
    kv._spec = reader.runner.kv_spec  # what register_kv_cache keeps: no agent needed here
    parts = kv.read_parts(len(dst), holder.share_pages("s"), reader.share_pages("t", have))
    g = reader.runner.kv_plan.num_groups
    assert sum(len(local) for _, _, local in parts) < g * len(dst)  # early windows not read
    for slots, remote, local in parts:
        for slot in slots:
            reader.runner.kv[slot][:, local] = holder.runner.kv[slot][:, remote]
    assert reader.end_import("t", True) == tokens and holder.end_export("s")
    reader.add_request("b", turn2, SamplingParams(max_tokens=GEN, temperature=0.0,
                                                  ignore_eos=True))
    out = []
    for _ in range(1000):
        if not reader.has_unfinished():
            break
        out += reader.step()
    assert [t for o in out for t in o.new_token_ids] == want
    assert out[-1].num_cached_tokens == tokens  # continued from the pulled prefix
    for e in (holder, reader):
        assert e.block_manager.num_free_pages == e.block_manager.num_pages


def test_a_pull_from_a_holder_lacking_a_page_is_refused_before_any_read(hf_model_dir) -> None:
    from kvrelay.kv_transfer.connector import NixlConnector
    from kvrelay.kv_transfer.errors import KVTransferError

    model_dir = hf_model_dir("gemma3")
    reader = core(model_dir, None)
    prompt = prompts(9, (48,))[0]
    dst, _ = reader.begin_import("t", prompt)
    local = reader.share_pages("t")
    kv = NixlConnector(NixlConnectorConfig("prefill", "model"))
    kv._spec = reader.runner.kv_spec
    remote = list(local)
    remote[-1] = -1  # the holder gave that page back
    with pytest.raises(KVTransferError, match="lacks layer group"):
        kv.read_parts(len(dst), remote, local)
    reader.end_import("t", False)
    assert reader.block_manager.num_free_pages == reader.block_manager.num_pages


def test_a_reservation_keeps_its_cached_prefixs_window_from_eviction_until_the_kv_arrives(
        hf_model_dir) -> None:
    """Turn two's reservation on the decode worker that generated turn one matches the history
    as its cached prefix; the prefill worker continues from there and may pull that prefix from
    here meanwhile (P<-D), so the reservation keeps its last window's pages (which it will not
    read itself) from eviction until the KV arrives; then they are idle, the pool's to take."""
    model_dir = hf_model_dir("gemma3")
    dst = core(model_dir, Arrivals(), block_size=16)
    bm = dst.block_manager
    turn1 = prompts(10, (150,))[0]
    dst.reserve("r", turn1)
    dst.connector.received.append("r")  # type: ignore[attr-defined]
    dst.step()
    dst.start_decode("r", 5, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    history = turn1 + [5] + drain(dst)["r"]
    held = (len(history) - 1) // 16 * 16  # the full blocks of the context computed: 176
    turn2 = history + prompts(11, (20,))[0]
    res = dst.reserve("r2", turn2)
    assert res.num_cached_tokens == held
    fill(dst, "f1")  # the pool needs every page: idle ones go, the kept window does not
    assert dst.export_prefix("s", turn2[:held]) == (res.block_ids[:held // 16], held)
    assert dst.end_export("s")
    dst.abort("f1")
    dst.connector.received.append("r2")  # type: ignore[attr-defined]
    dst.step()  # arrived: the reservation lets the prefix's window go (idle)
    fill(dst, "f2")
    assert dst.export_prefix("s2", turn2[:held]) == ([], 0)
    for rid in ("r2", "f2"):
        dst.abort(rid)
    drain(dst)
    assert bm.num_free_pages == bm.num_pages


def fill(engine: EngineCore, rid: str) -> None:
    """Reserve a fresh prompt of every block the pool can give (evicting idle pages)."""
    n = engine.block_manager.num_free_blocks * engine.block_manager.block_size
    engine.reserve(rid, [(7 + i) % 400 + 3 for i in range(n)])


def test_kv_head_groups_ask_for_one_table(hf_model_dir) -> None:
    """KV head groups lay a one-table tensor out as a TP peer's ranks: under the default hybrid
    layout a sliding-window hybrid is refused, naming the flag that serves it."""
    model_dir = hf_model_dir("gemma3")
    with pytest.raises(ValueError, match="--hybrid-kv off"):
        core(model_dir, None, kv_head_groups=2)
    assert core(model_dir, None, kv_head_groups=2, hybrid_kv="off").runner.kv_groups == 2
