"""Sliding-window KV (``engine/kv_window.py``): a prompt's KV handed to a decode worker carries,
for each windowed layer, only the blocks that layer still reads from the handoff on; the
receiver never reads what was skipped and never serves those blocks as a cached prefix.

- the arithmetic against its definition (which positions each layer attends after the handoff);
- the sender's writes (``kv_transfer/sending.py`` over a recording stand-in for the I/O thread):
  streamed by chunks, layer by layer or whole, and late (a destination named after the prompt
  finished), every layer gets exactly the blocks it reads;
- the receiver: a Gemma 3 and a windowed Mistral decode from a copy of only those blocks, the
  rest poisoned (NaN for the native paged decode kernel, which must not even load them; huge
  finite values for torch SDPA, which gathers whole block tables and masks), with transformers'
  logits; a withheld sequence's blocks never match as a prefix.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hf_models import hf_greedy
from test_engine_parity import GREEDY, make_core, prompts

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.cpu import native as native_kernels
from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.kv_window import LayerWindows, block_needs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.kv_transfer.config import NixlConnectorConfig
from kvrelay.kv_transfer.messages import KVDestination, PendingDestination
from kvrelay.kv_transfer.sending import Sending
from kvrelay.kv_transfer.transfer_thread import WriteJob

BS = 8


def read_after_handoff(num_prompt_tokens: int, window: int | None, decodes: int = 40) -> set[int]:
    """The prompt blocks a layer attends to from the handoff on, by the definition: the token at
    position p sees keys (p - window, p]."""
    out = set()
    for p in range(num_prompt_tokens, num_prompt_tokens + decodes):
        lo = 0 if window is None else max(0, p - window + 1)
        out.update(k // BS for k in range(lo, min(p + 1, num_prompt_tokens)))
    return out


# -- the arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [1, 7, 8, 9, 23, 24, 25, 40, 70, 129])
@pytest.mark.parametrize("window", [1, 7, 8, 9, 24, 40, 200, None])
def test_needs_select_exactly_the_blocks_each_window_reads(prompt: int, window: int | None):
    n = -(-prompt // BS)
    needs = block_needs(0, n, prompt, BS)
    kept = {i for i, need in enumerate(needs) if window is None or need <= window}
    assert kept == read_after_handoff(prompt, window)
    lw = LayerWindows((window, None))
    assert lw.has_holes(prompt, BS) == (window is not None and kept != set(range(n)))


def test_split_groups_layers_by_window_and_drops_empty_writes():
    lw = LayerWindows((16, None, 16, 8))
    local, remote = [10, 11, 12, 13], [20, 21, 22, 23]
    needs = block_needs(0, 4, 32, BS)  # 26, 18, 10, 2
    got = {w.layers: (w.local, w.remote) for w in lw.split(range(4), local, remote, needs)}
    assert got == {(0, 2): ([12, 13], [22, 23]), (1,): (local, remote), (3,): ([13], [23])}
    assert lw.split((3,), [10], [20], block_needs(0, 1, 32, BS)) == []  # nothing for layer 3
    assert LayerWindows((None, None)).split((0, 1), local, remote, needs)[0].local == local


# -- the sender -------------------------------------------------------------------------------
class _Transport:
    def peer_incarnation(self, peer: str) -> str | None:
        return None


class _Recorder:
    """The I/O thread's stand-in: keeps every job."""

    def __init__(self) -> None:
        self.jobs: list[object] = []

    def submit(self, job: object) -> None:
        self.jobs.append(job)


def _sending(windows: tuple[int | None, ...], layerwise: str) -> tuple[Sending, _Recorder]:
    spec = KVCacheSpec(len(windows), 2, 16, BS, 64, layer_windows=windows)
    s = Sending(NixlConnectorConfig("prefill", "model", layerwise=layerwise))
    s.attach(_Transport(), spec, torch.device("cpu"))  # type: ignore[arg-type]
    rec = _Recorder()
    s._io = lambda: rec  # type: ignore[method-assign]
    return s, rec


def _written(jobs: list[object], layers: int) -> list[dict[int, int]]:
    """Per layer: remote block -> local block, over every write."""
    out: list[dict[int, int]] = [{} for _ in range(layers)]
    for job in jobs:
        if isinstance(job, WriteJob):
            for layer in job.layers:
                for lo, re in zip(job.local, job.remote, strict=True):
                    out[layer][re] = lo
    return out


def _seq(prompt: int, params: object) -> Sequence:
    seq = Sequence("r", list(range(prompt)), SamplingParams(), kv_transfer_params=params)
    n = -(-prompt // BS)
    seq.block_table = list(range(3, 3 + n))
    seq.status = SequenceStatus.RUNNING
    return seq


@pytest.mark.parametrize("layerwise", ["on", "off"])
@pytest.mark.parametrize("windows", [(24, 24, None), (16, 16, 16), (None, None)])
def test_each_layer_is_written_exactly_the_blocks_it_reads(windows, layerwise: str):
    prompt, chunk = 70, 24
    n = -(-prompt // BS)
    remote = list(range(30, 30 + n))
    s, rec = _sending(windows, layerwise)
    seq = _seq(prompt, KVDestination("decode", remote, 0, b"n"))
    for start in range(0, prompt, chunk):
        k = min(chunk, prompt - start)
        s.start_step([ScheduledSeq(seq, k)])
        for layer in range(len(windows)):
            s.save_layer(layer)
        s.end_step()
        seq.num_computed_tokens = start + k
    assert s.finished(seq, seq.kv_transfer_params)
    for layer, got in enumerate(_written(rec.jobs, len(windows))):
        want = read_after_handoff(prompt, windows[layer])
        assert got == {remote[i]: seq.block_table[i] for i in want}, (layer, windows[layer])


def test_a_destination_named_late_sends_the_same_blocks():
    windows, prompt = (16, None, 16), 50
    n = -(-prompt // BS)
    remote = list(range(30, 30 + n))
    s, rec = _sending(windows, "on")
    pending = PendingDestination()
    seq = _seq(prompt, pending)
    s.start_step([ScheduledSeq(seq, prompt)])
    for layer in range(3):
        s.save_layer(layer)
    s.end_step()
    seq.num_computed_tokens = prompt
    assert s.finished(seq, pending)
    assert not rec.jobs
    pending.resolve(KVDestination("decode", remote, 0, b"n"))
    s.destination_ready("r")
    for layer, got in enumerate(_written(rec.jobs, 3)):
        want = read_after_handoff(prompt, windows[layer])
        assert got == {remote[i]: seq.block_table[i] for i in want}


# -- the receiver -----------------------------------------------------------------------------
def test_partial_blocks_end_a_prefix_only_where_no_window_reads_them():
    """Blocks 0-2 of five lack the windowed layers' KV (window 16, blocks of 8): a prefix of all
    five may be continued (its windowed layers read from position 25 on: blocks 3 and 4), a
    prefix of four may not (from 17 on: block 2), nor any shorter; a copy for a peer takes none;
    a whole copy computed later takes the index back."""
    bm = BlockManager(16, BS)
    bm.hole_window = 16
    a = Sequence("a", list(range(40)), SamplingParams())
    assert bm.allocate(a, 40)
    a.num_computed_tokens = 40
    bm.mark_holes(a, 0, 3)
    bm.publish(a)
    child = Sequence("c", list(range(40)), SamplingParams())
    bm.fork(a, child)  # shares the partial blocks
    assert bm.match_prefix(list(range(40)), 40).num_blocks == 5
    for n in (8, 16, 24, 32):
        assert bm.match_prefix(list(range(40)), n).num_blocks == 0, n
    assert bm.match_prefix(list(range(40)), 40, complete=True).num_blocks == 0
    bm.free(a)
    bm.free(child)
    b = Sequence("b", list(range(40)), SamplingParams())  # computed whole here
    b.block_table = [bm._take_free() for _ in range(5)]  # fresh blocks, not the cached ones
    b.num_computed_tokens = 40
    bm.publish(b)
    assert bm.match_prefix(list(range(40)), 32, complete=True).num_blocks == 4
    bm.free(b)
    assert bm.num_free_blocks == 16


@functools.cache
def _reference(model_dir: str, prompt: tuple[int, ...]) -> Any:
    return hf_greedy(model_dir, list(prompt), 8)


def _handoff_decode(hf_model_dir, name: str, backend: str, poison: float) -> None:
    """Prefill on one engine, copy to a second engine only the blocks each layer reads (the rest
    ``poison``), decode there: logits as transformers'."""
    model_dir = hf_model_dir(name)
    prompt = prompts(2, (70,))[0]
    ref = _reference(model_dir, tuple(prompt))
    src, dst = make_core(model_dir, attention_backend=backend, hybrid_kv="off"), \
        make_core(model_dir, attention_backend=backend, hybrid_kv="off")
    windows = LayerWindows(dst.runner.kv_spec.layer_windows)
    assert windows.has_holes(len(prompt), BS)
    tokens = prompt + ref.token_ids
    a, b = (Sequence(r, tokens, GREEDY) for r in "ab")
    for core, seq in ((src, a), (dst, b)):
        seq.num_prompt_tokens = len(prompt)
        assert core.block_manager.allocate(seq, len(tokens))
    for start in range(0, len(prompt), 24):
        k = min(24, len(prompt) - start)
        src.runner.logits_for([ScheduledSeq(a, k)])
        a.num_computed_tokens = start + k
    kv_a, kv_b = src.runner.kv, dst.runner.kv
    kv_b.fill_(poison)
    n = -(-len(prompt) // BS)
    layers = range(dst.runner.kv_spec.num_layers)
    copied = 0
    for w in windows.split(layers, a.block_table[:n], b.block_table[:n],
                           block_needs(0, n, len(prompt), BS)):
        for layer in w.layers:
            kv_b[layer][:, w.remote] = kv_a[layer][:, w.local]
            copied += len(w.local)
    assert copied < len(layers) * n  # some blocks were skipped
    b.num_computed_tokens = len(prompt)
    got = []
    for _ in ref.token_ids[:-1]:
        got.append(dst.runner.logits_for([ScheduledSeq(b, 1)])[0])
        b.num_computed_tokens += 1
    ref_dec = ref.logits[1:]
    err = float((torch.stack(got) - ref_dec).abs().max() / ref_dec.abs().max())
    assert err < 1e-4, (name, backend, err)


@pytest.mark.parametrize("name", ["gemma3_mqa_scaled", "mistral_swa"])
def test_native_decode_never_loads_the_skipped_blocks(hf_model_dir, name: str):
    if not native_kernels.available():
        pytest.skip("no native kernels here")
    _handoff_decode(hf_model_dir, name, "native", float("nan"))


@pytest.mark.parametrize("name", ["gemma3_mqa_scaled"])
def test_sdpa_decode_masks_the_skipped_blocks(hf_model_dir, name: str):
    _handoff_decode(hf_model_dir, name, "sdpa", 1e30)


# -- blocks held: every layer windowed ----------------------------------------------------------
def _decoding(bm: BlockManager, rid: str, prompt: int) -> Sequence:
    seq = Sequence(rid, list(range(prompt)), SamplingParams())
    assert bm.allocate(seq, prompt + 1)
    seq.num_computed_tokens = prompt
    bm.publish(seq)
    return seq


def test_blocks_wholly_before_the_window_go_back_once_decoding():
    bm = BlockManager(32, BS)
    bm.release_window = 16
    seq = _decoding(bm, "a", 40)
    assert bm.release_out_of_window(seq) == 0  # the prompt's own step: a sender may read it
    held = []
    for _ in range(60):
        seq.append_token(7)
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens += 1
        bm.publish(seq)
        bm.release_out_of_window(seq)
        # the next token, at position num_computed, sees keys from num_computed - 15 on
        assert bm.held_blocks(seq) == len(seq.block_table) - (seq.num_computed_tokens - 15) // BS
        held.append(bm.held_blocks(seq))
    assert max(held) <= 16 // BS + 2
    assert bm.num_released_blocks == len(seq.block_table) - bm.held_blocks(seq)
    assert bm.num_free_blocks == 32 - bm.held_blocks(seq)
    child = Sequence("c", list(seq.token_ids), SamplingParams())
    bm.fork(seq, child)
    bm.free(seq)
    assert bm.num_free_blocks == 32 - bm.held_blocks(child)
    bm.free(child)
    assert bm.num_free_blocks == 32  # nothing freed twice, nothing lost
    # the released blocks kept their published prefix (whole KV) until reused
    assert bm.match_prefix(list(range(40)), 40).num_blocks == 5


def test_a_hybrid_model_holds_every_block():
    assert LayerWindows((24, 24, None)).common_window is None
    assert LayerWindows((48, 48)).common_window == 48
    bm = BlockManager(32, BS)  # release_window None: Gemma 3's global layers read everything
    seq = _decoding(bm, "a", 40)
    seq.append_token(7)
    assert bm.allocate(seq, 41)
    seq.num_computed_tokens = 41
    assert bm.release_out_of_window(seq) == 0 and bm.held_blocks(seq) == 6


@pytest.mark.parametrize("backend", ["sdpa"])  # it gathers whole tables: the stale ids too
def test_a_windowed_mistral_decodes_long_in_a_pool_it_would_overflow(hf_model_dir, backend):
    """Two 100-token generations of a window-48 Mistral, side by side in a pool of 28 blocks
    of 8 tokens: each needs 17 blocks without releases (34: preemptions), and holds 8 at most
    with them; the blocks they give back are reused by the other as both go on (stale ids in
    their tables, masked). Greedy tokens are transformers'."""
    from test_engine_parity import hf_tokens, run

    model_dir = hf_model_dir("mistral_swa")
    core = make_core(model_dir, num_blocks=28, attention_backend=backend)
    assert core.block_manager.release_window == 48
    ps = prompts(5, (30, 33))
    sp = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    got = run(core, {f"r{i}": (p, sp) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), 100), len(p)  # cached for both
    bm = core.block_manager
    assert bm.num_released_blocks >= 2 * 9
    assert core.stats().num_preemptions == 0
    assert bm.num_free_blocks == 28


@pytest.mark.parametrize("prompt", [70, 20])
def test_a_windowed_arrival_marks_its_holes_and_its_head_is_found_again(hf_model_dir,
                                                                      prompt: int):
    """A reservation's KV arriving for a prompt past the window (70 tokens, window 24, blocks
    of 8: the sender skipped blocks 0-4 for the local layers) is cached as partial, its fork's
    too (n = 2, forked before the arrival: the same blocks). A follow-up turn that extends the
    whole prompt finds its 8 full blocks at its reservation (its local layers read from
    position 41 on); a prompt that diverges at 48 finds none (its local layers would read
    blocks 3 and 4); a copy for a peer takes none. Within the window (20 tokens) nothing was
    skipped."""
    # windows (24, 24, None), blocks of 8; one block table (the hybrid layout's handoff:
    # tests/test_hybrid_handoff.py)
    core = make_core(hf_model_dir("gemma3"), hybrid_kv="off")
    bm = core.block_manager
    ids = prompts(6, (prompt,))[0]
    core.reserve("a", ids)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2)
    core.start_decode("a", 5, sp, forks=[("a.1", 6)])
    core._kv_arrived(core.seqs["a"])  # what the connector's "received" event does
    while core.has_unfinished():
        core.step()
    full = prompt // 8
    assert bm.match_prefix(ids, prompt, complete=True).num_blocks == (0 if prompt > 24 else full)
    follow_up = ids + prompts(7, (30,))[0]
    assert core.reserve("b", follow_up).num_cached_tokens == full * 8
    if prompt > 24:
        assert bm.match_prefix(ids[:48] + [9] * 8, 56).num_blocks == 0
