"""The GPU smoke: what a bare GPU machine can check of kvrelay in a few minutes.

Runs from the source tree (``smoke.sh`` puts a ``kvrelay`` shim and this folder on
``PYTHONPATH``), on a system Python that has torch with CUDA, transformers and pytest, and
optionally NIXL (as wheels brought along). flash-attn may be absent: ``flash_standin/`` provides
a pure-torch, graph-safe ``flash_attn_varlen_func`` under its name, so the engine's flash path
(paged ``block_table`` reads, CUDA graphs) runs; ``environment`` says which one ran.

Each phase runs in its own process under its own timeout, so a crash or a hang costs one phase.
Results go to ``$OUT/smoke.json`` (or ``--out``) after every phase, and one line per phase is
printed: ``PASS``, ``FAIL``, ``INFO`` (measured, no verdict) or ``SKIP`` (with why). On a
machine without CUDA the CPU-checkable phases run and the others say they were skipped.

    python tests/gpu/smoke.py [--out DIR] [--only PHASE,...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


class Skip(Exception):
    """A phase that cannot run here (no CUDA, no NIXL): reported as SKIP with the reason."""


# -- shared pieces -------------------------------------------------------------------------------
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# A developer's dry run of the phases' own code on the CPU (SDPA, no graphs):
# KVRELAY_SMOKE_DEVICE=cpu KVRELAY_SMOKE_BACKEND=sdpa. The GPU tests' bodies still need CUDA.
DRY_DEVICE = os.environ.get("KVRELAY_SMOKE_DEVICE")
BACKEND = os.environ.get("KVRELAY_SMOKE_BACKEND", "flash")


def _need_cuda(dry_ok: bool = False) -> None:
    if not _cuda() and not (dry_ok and DRY_DEVICE):
        raise Skip("no CUDA device visible to torch")


def _need_nixl() -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        raise Skip(f"NIXL not importable ({e}); bring the wheels (tests/gpu/README.md)") from e


@functools.cache
def model_dir(arch: str, **overrides: Any) -> str:
    """A tiny random-weight checkpoint of ``arch`` (tests/hf_models.py), once per process."""
    from hf_models import make_hf_model

    root = os.environ.get("KVRELAY_SMOKE_MODELS") or tempfile.mkdtemp(prefix="kvr-smoke-")
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = os.path.join(root, f"{arch}{'-' + tag if tag else ''}")
    if os.path.exists(os.path.join(path, "config.json")):  # an earlier phase wrote it
        return path
    return make_hf_model(path, arch, **overrides)


def hf_model_dir(arch: str, **overrides: Any) -> str:
    """The signature of the GPU tests' ``hf_model_dir`` fixture, so their bodies run as is."""
    return model_dir(arch, **overrides)


def run_test(fn: Callable[..., None], *args: Any) -> str:
    """Run one of tests/gpu's test functions; 'passed', 'skipped: why' or raises."""
    import pytest

    try:
        with pytest.MonkeyPatch.context() as mp:
            if "monkeypatch" in fn.__code__.co_varnames[:fn.__code__.co_argcount]:
                fn(*args, mp)
            else:
                fn(*args)
    except pytest.skip.Exception as e:
        return f"skipped: {e}"
    return "passed"


def _gpu() -> str:
    import torch

    return DRY_DEVICE or f"cuda:{torch.cuda.device_count() - 1}"


def _rel(got: Any, ref: Any) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).abs().max() / ref.abs().max())


# -- phases --------------------------------------------------------------------------------------
def phase_environment() -> dict[str, Any]:
    """INFO: torch and its CUDA, the GPU, flash-attn (real or the stand-in), NIXL, NCCL."""
    import importlib.metadata as md

    import torch
    import transformers

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    info: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(), "nixl": version("nixl"),
        "nixl_cu12": version("nixl-cu12"), "nixl_cu13": version("nixl-cu13"),
    }
    try:
        import flash_attn

        info["flash_attn"] = getattr(flash_attn, "__version__", "?")
        info["flash_attn_standin"] = bool(getattr(flash_attn, "STANDIN", False))
    except ImportError:
        info["flash_attn"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpus=torch.cuda.device_count(), gpu=p.name,
                    capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count, nccl=str(torch.cuda.nccl.version()),
                    expandable_segments="expandable_segments:True" in os.environ.get(
                        "PYTORCH_CUDA_ALLOC_CONF", ""))
    with contextlib.suppress(ImportError):
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent("smoke-env", nixl_agent_config(backends=["UCX"]))
        info["nixl_backends"] = list(agent.backends)
        info["nixl_plugins"] = list(agent.get_plugin_list())
    return {"status": "INFO", **info}


def phase_standin_vs_reference() -> dict[str, Any]:
    """The flash stand-in against per-sequence SDPA (paged and packed K/V, GQA, a window)."""
    import torch
    import torch.nn.functional as F
    from flash_attn import flash_attn_varlen_func as flash

    dev = "cuda" if _cuda() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, dim, bs = 8, 2, 64, 16
    qlens, klens = [7, 1, 1, 40], [50, 33, 1, 40]
    worst = 0.0
    for window in ((-1, -1), (11, 0)):
        q = torch.randn(sum(qlens), heads, dim, generator=g).to(dev)
        kc = torch.randn(32, bs, kv_heads, dim, generator=g).to(dev)
        vc = torch.randn(32, bs, kv_heads, dim, generator=g).to(dev)
        tables = torch.tensor([[5, 9, 2, 30], [1, 4, 7, 0], [12, 0, 0, 0], [20, 21, 22, 0]],
                              dtype=torch.int32, device=dev)
        cq = torch.tensor([0, *qlens], device=dev).cumsum(0).int()
        ck = torch.tensor([0, *klens], device=dev).cumsum(0).int()
        out = flash(q, kc, vc, cq, ck, max(qlens), max(klens), causal=True, window_size=window,
                    block_table=tables)
        for b, (nq, nk) in enumerate(zip(qlens, klens, strict=True)):
            slots = (tables[b].long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()[:nk]
            ks = kc.view(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
            vs = vc.view(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
            at = nk - nq + torch.arange(nq, device=dev)[:, None]
            j = torch.arange(nk, device=dev)[None]
            mask = (j <= at) & ((j >= at - window[0]) if window[0] >= 0 else True)
            ref = F.scaled_dot_product_attention(q[cq[b]:cq[b + 1]].transpose(0, 1),
                                                 ks.transpose(0, 1), vs.transpose(0, 1),
                                                 attn_mask=mask).transpose(0, 1)
            worst = max(worst, float((out[cq[b]:cq[b + 1]] - ref).abs().max()))
    ok = worst < 1e-3
    return {"status": "PASS" if ok else "FAIL", "device": dev, "max_abs_err": worst}


def phase_bf16_vs_transformers() -> dict[str, Any]:
    """The engine in bf16 on the GPU against transformers: greedy tokens (bf16 both) and the
    prompt's logits against transformers in fp32 (max |diff| over the logits' range)."""
    _need_cuda(dry_ok=True)
    import test_attention_gpu as t
    import torch
    from transformers import AutoModelForCausalLM

    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sequence import Sequence

    dev = _gpu()
    out: dict[str, Any] = {}
    ok = True
    for arch in ("llama", "qwen3", "mistral_swa"):
        md = model_dir(arch)
        core = t.make_core(md, dev, BACKEND)
        prompt = t.ids(3, 77)
        seq = Sequence("p", prompt, t.GREEDY)
        assert core.block_manager.allocate(seq, len(prompt))
        got = core.runner.logits_for([ScheduledSeq(seq, len(prompt))]).float()
        core.block_manager.free(seq)
        hf = AutoModelForCausalLM.from_pretrained(md, dtype=torch.float32).to(dev).eval()
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt], device=dev)).logits[0].float()
            hf16 = hf.to(torch.bfloat16)(torch.tensor([prompt], device=dev)).logits[0].float()
        span = float(ref.max() - ref.min())
        err = float((got - ref).abs().max()) / span
        yardstick = float((hf16 - ref).abs().max()) / span  # transformers' own bf16 error
        # teacher-forced: at how many of the prompt's positions the top token is fp32's
        agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        agree16 = float((hf16.argmax(-1) == ref.argmax(-1)).float().mean())
        greedy = _greedy_agreement(core, md, dev, near_tie=2 * yardstick)
        out[arch] = {"logit_err_over_range": round(err, 5),
                     "hf_bf16_err_over_range": round(yardstick, 5),
                     "top1_agreement_with_fp32": round(agree, 4),
                     "hf_bf16_top1_agreement_with_fp32": round(agree16, 4),
                     "free_running_greedy": greedy, "backend": core.runner.backend}
        ok &= err <= max(2 * yardstick, 0.01) and agree >= agree16 - 1.5 / len(prompt)
        del core, hf
        if _cuda():
            torch.cuda.empty_cache()
    return {"status": "PASS" if ok else "FAIL",
            "tolerance": "vs transformers fp32: max|dlogit| <= 2x transformers bf16's own, and "
                         "the top token at as many prompt positions as transformers bf16 (-1)",
            **out}


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def _greedy_agreement(core: Any, md: str, dev: str, near_tie: float,
                      n: int = 16) -> dict[str, Any]:
    """Free-running greedy tokens of the engine (bf16) and of transformers in bf16, each
    against transformers in fp32: the index of the first token that differs, and fp32's top-2
    margin there. Reported, not judged: once one token differs the rest follow another text, so
    the verdict is the teacher-forced agreement above. ``ok`` says whether the engine followed
    fp32 as far as transformers' bf16 did, or parted at a near tie (a margin within
    ``near_tie`` of the logits' range)."""
    import test_attention_gpu as t
    import torch
    from transformers import AutoModelForCausalLM

    # two models read from disk: casting one back and forth would round the fp32 reference
    hf32 = AutoModelForCausalLM.from_pretrained(md, dtype=torch.float32).to(dev).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(md, dtype=torch.bfloat16).to(dev).eval()

    prompts = {f"r{i}": t.ids(10 + i, k) for i, k in enumerate((5, 33, 70))}
    for rid, p in prompts.items():
        core.add_request(rid, p, t.GREEDY)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_unfinished():
        for o in core.step():
            got[o.request_id] += o.new_token_ids
    res: dict[str, Any] = {}
    for rid, p in prompts.items():
        x = torch.tensor([p], device=dev)
        with torch.inference_mode():
            g32 = hf32.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
            bf16 = hf16.generate(x, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)[0, len(p):].tolist()
        fp32 = g32.sequences[0, len(p):].tolist()
        ours, theirs = _first_diff(got[rid], fp32), _first_diff(bf16, fp32)
        margin = None
        if ours < n:
            top = torch.topk(g32.logits[ours][0].float(), 2).values
            span = float(g32.logits[ours][0].max() - g32.logits[ours][0].min())
            margin = round(float(top[0] - top[1]) / span, 5)
        res[rid] = {"engine_bf16_vs_fp32_first_diff": ours, "hf_bf16_vs_fp32_first_diff": theirs,
                    "fp32_top2_margin_over_range_there": margin,
                    "ok": ours >= min(theirs, 8) or (margin is not None and margin < near_tie)}
    return res


def phase_flash_vs_sdpa() -> dict[str, Any]:
    """tests/gpu/test_attention_gpu.py's scenarios: the flash path (paged block_table reads)
    against SDPA in bf16, four step shapes x four architectures (one with a window on every
    layer, one a sliding-window hybrid on the hybrid KV layout: a page table per layer group)."""
    _need_cuda()
    import test_attention_gpu as t

    results = {}
    for arch in ("llama", "qwen3", "mistral_swa", "gemma3"):
        for name in ("fresh_prefill", "chunk_over_cached_prefix", "mixed_prefill_decode",
                     "decode_only"):
            try:
                results[f"{arch}/{name}"] = run_test(t.test_flash_matches_sdpa, hf_model_dir,
                                                     _gpu(), arch, name)
            except AssertionError as e:
                results[f"{arch}/{name}"] = f"FAILED: {e}"
    results["fp32_takes_sdpa"] = run_test(t.test_fp32_on_cuda_takes_sdpa, hf_model_dir, _gpu())
    ok = all(v == "passed" for v in results.values())
    return {"status": "PASS" if ok else "FAIL", **results}


def phase_cuda_graphs() -> dict[str, Any]:
    """tests/gpu/test_cuda_graphs_gpu.py: replayed decode steps against eager ones (logits over
    36 steps of batch 1..24, the KV blocks after), and greedy tokens through the engine."""
    _need_cuda()
    import test_cuda_graphs_gpu as t

    results = {}
    for arch in ("llama", "qwen3"):
        try:
            results[arch] = run_test(t.test_graph_decode_matches_eager, hf_model_dir, _gpu(), arch)
        except AssertionError as e:
            results[arch] = f"FAILED: {e}"
    try:
        results["engine_replays"] = run_test(t.test_engine_steps_replay_graphs, hf_model_dir,
                                             _gpu())
    except AssertionError as e:
        results["engine_replays"] = f"FAILED: {e}"
    ok = all(v == "passed" for v in results.values())
    return {"status": "PASS" if ok else "FAIL", **results}


def phase_kv_layout() -> dict[str, Any]:
    """Heads first inside a KV block (``--kv-layout auto`` on CUDA) against tokens first: the
    flash path reads the strided block view, CUDA graphs replay decode over it, and greedy
    tokens (prompts in one block, across blocks, chunked) equal the token-major cache's."""
    _need_cuda(dry_ok=True)
    import random

    from kvrelay.engine.llm import LLM
    from kvrelay.engine.sampling_params import SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(7, 250) for _ in range(n)] for n in (5, 300, 700)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got: dict[str, Any] = {}
    first = "heads" if DRY_DEVICE else "auto"  # a dry run on the CPU asks for it by name
    for layout in (first, "tokens"):
        llm = LLM(model_dir("llama"), device=_gpu(), dtype="bfloat16",
                  attention_backend=BACKEND, block_size=256, num_blocks=48, max_model_len=1024,
                  max_num_batched_tokens=512, kv_layout=layout, seed=0)
        runner = llm.engine.runner
        got[layout] = {"heads_first": runner.heads_first,
                       "graphs": runner.decode_graphs is not None,
                       "tokens": [o.token_ids for o in llm.generate(prompts, sp)]}
        del llm, runner
    same = got[first]["tokens"] == got["tokens"]["tokens"]
    ok = same and got[first]["heads_first"]
    return {"status": "PASS" if ok else "FAIL", "heads_first": got[first]["heads_first"],
            "graphs": got[first]["graphs"], "greedy_equal": same}


def phase_kv_sizing() -> dict[str, Any]:
    """Without ``--kv-cache-memory`` the cache takes what ``--gpu-memory-utilization`` (here
    0.3) leaves once the largest step has run: the warm-up step's bytes, the cache's, and a
    step of that size run afterwards (it must fit beside the cache)."""
    _need_cuda()
    import torch

    from kvrelay.engine.llm import LLM
    from kvrelay.engine.sampling_params import SamplingParams

    dev = torch.device(_gpu())
    held = torch.cuda.memory_reserved(dev)
    llm = LLM(model_dir("llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=4),
              device=_gpu(), dtype="bfloat16", attention_backend=BACKEND,
              max_num_batched_tokens=2048, gpu_memory_utilization=0.3, seed=0)
    runner = llm.engine.runner
    total = torch.cuda.mem_get_info(dev)[1]
    kv = runner.kv.numel() * runner.kv.element_size()
    llm.generate([list(range(7, 2055))], SamplingParams(max_tokens=4, ignore_eos=True))
    peak = torch.cuda.max_memory_reserved(dev)
    ok = runner.warm_up_bytes is not None and peak <= 0.3 * total + held
    return {"status": "PASS" if ok else "FAIL",
            "warm_up_gib": (runner.warm_up_bytes or 0) / 2**30,
            "kv_gib": kv / 2**30, "kv_blocks": runner.kv_spec.num_blocks,
            "max_reserved_gib": peak / 2**30, "share_gib": 0.3 * total / 2**30}


def phase_tp_shard_load() -> dict[str, Any]:
    """Rank 0 of TP=2 loads its shard straight to the GPU (``tp_shard.shard_model`` with
    ``weights.Cuts``, no process group needed to load): every parameter on the device, the
    device holding the shard and not the model, and the shard's weights the checkpoint's own
    rows and columns."""
    _need_cuda()
    import datetime

    import torch

    from kvrelay.engine.loader import iter_checkpoint, load_model
    from kvrelay.engine.tp_shard import TPShard

    dev = torch.device(_gpu())
    md = model_dir("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                   dtype=torch.bfloat16)
    full = {name: t for name, t in iter_checkpoint(md)}
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    shard = TPShard(rank=0, size=2, group=None,  # type: ignore[arg-type]
                    timeout=datetime.timedelta(seconds=30))
    model, _ = load_model(md, device=dev, dtype=torch.bfloat16, attn_fn=None,  # type: ignore
                          max_positions=256, shard=shard)
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev) - before
    params = list(model.parameters())
    on_device = all(p.device == dev for p in params)
    shard_bytes = sum(p.numel() * p.element_size() for p in params)
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    a, m = model.layers[1].attn, model.layers[1].mlp
    q = full["model.layers.1.self_attn.q_proj.weight"]
    o = full["model.layers.1.self_attn.o_proj.weight"]
    gate = full["model.layers.1.mlp.gate_proj.weight"]
    rows_ok = (torch.equal(a.qkv.weight[:q.shape[0] // 2].cpu(), q[:q.shape[0] // 2])
               and torch.equal(a.o.weight.cpu(), o[:, :o.shape[1] // 2])
               and torch.equal(m.gate_up.weight[:gate.shape[0] // 2].cpu(),
                               gate[:gate.shape[0] // 2]))
    ok = on_device and rows_ok and held < 0.75 * full_bytes
    return {"status": "PASS" if ok else "FAIL", "on_device": on_device, "rows_equal": rows_ok,
            "device_mib": held / 2**20, "shard_mib": shard_bytes / 2**20,
            "checkpoint_mib": full_bytes / 2**20}


def _decoding_core(graphs: bool, max_batch: int = 64, **model: Any) -> Any:
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore

    return EngineCore(EngineConfig.from_kwargs(
        model_dir("llama", **model), device=_gpu(), dtype="bfloat16", attention_backend=BACKEND,
        block_size=256, num_blocks=160, max_model_len=1024, max_num_seqs=max_batch,
        cuda_graph_max_batch=max_batch, enforce_eager=not graphs or bool(DRY_DEVICE), seed=0))


def phase_host_syncs() -> dict[str, Any]:
    """INFO: host syncs per decode step (``torch.cuda.set_sync_debug_mode``), greedy and with
    temperature/top-p sampling. The step loop reads its tokens back once by design."""
    _need_cuda(dry_ok=True)
    import torch

    from kvrelay.engine.sampling_params import SamplingParams

    out: dict[str, Any] = {}
    for graphs in (True, False):
        core = _decoding_core(graphs, max_batch=16)
        for kind, sp in (("greedy", SamplingParams(max_tokens=40, temperature=0.0,
                                                   ignore_eos=True)),
                         ("sampled", SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9,
                                                    seed=1, ignore_eos=True))):
            rng = random.Random(0)
            for i in range(8):
                core.add_request(f"{kind}{i}", [rng.randrange(3, 500) for _ in range(50)], sp)
            for _ in range(6):  # prefill and a few decode steps before counting
                core.step()
            steps = 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if _cuda():
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(10):
                        core.step()
                        steps += 1
                finally:
                    if _cuda():
                        torch.cuda.set_sync_debug_mode("default")
            while core.has_unfinished():
                core.step()
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            where = sorted({_sync_site(w) for w in caught if "synchroniz" in str(w.message)})
            out[f"{'graphs' if graphs else 'eager'}/{kind}"] = {
                "syncs_per_step": round(len(syncs) / max(steps, 1), 2), "sites": where[:12]}
        del core
        if _cuda():
            torch.cuda.empty_cache()
    return {"status": "INFO", **out}


def _sync_site(w: warnings.WarningMessage) -> str:
    return f"{os.path.relpath(w.filename, os.path.dirname(HERE))}:{w.lineno}"


def phase_nixl_vram() -> dict[str, Any]:
    """NIXL between two processes on one GPU: byte-exact blocks over 50 rounds (now and behind
    a GPU sleep before the writing kernel), then GB/s of a 128 MiB write; the UCX protocols
    chosen (UCX_PROTO_INFO) are in the phase's log."""
    _need_cuda()
    _need_nixl()
    import test_transfer_gpu as t

    results = {}
    for delay in (False, True):
        try:
            results[f"byte_exact{'_delayed' if delay else ''}"] = run_test(
                t.test_handoff_is_byte_exact_over_many_iterations, ("cuda:0", "cuda:0"), delay)
        except AssertionError as e:
            results[f"byte_exact{'_delayed' if delay else ''}"] = f"FAILED: {e}"
    gbps = t._bandwidth(("cuda:0", "cuda:0"))
    results["write_gbps_same_gpu_across_processes"] = round(gbps, 2)
    ok = all(v == "passed" for k, v in results.items() if k.startswith("byte_exact"))
    return {"status": "PASS" if ok else "FAIL", **results}


def decode_child(conn: Any, model: str, device: str, name: str, prompt: list[int],
                 steps: int) -> None:
    """A decode engine in its own process: reserves blocks for ``prompt``, registers its KV
    with NIXL, waits for the prefill side's write and notification, then decodes greedily."""
    import torch

    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence
    from kvrelay.kv_transfer.cuda_sync import bind_thread_to
    from kvrelay.kv_transfer.layout import KVLayout
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    bind_thread_to(torch.device(device))
    core = EngineCore(EngineConfig.from_kwargs(model, device=device, dtype="bfloat16",
                                               attention_backend=BACKEND, block_size=256,
                                               num_blocks=32, enforce_eager=True, seed=0))
    tr = NixlTransport(name, core.runner.transfer_kv,
                       KVLayout.from_spec(core.runner.kv_spec, "smoke-model",
                                          torch.device(device).type))
    seq = Sequence("d", list(prompt), SamplingParams(max_tokens=steps, temperature=0.0))
    assert core.block_manager.allocate(seq, len(prompt) + steps)
    conn.send(("ready", tr.peer_info().to_bytes(), list(seq.block_table)))
    deadline = time.monotonic() + 60
    while not tr.get_notifs():
        if time.monotonic() > deadline:
            raise TimeoutError("no KV notification within 60 s")
        time.sleep(0.002)
    cmd = conn.recv()
    assert cmd[0] == "first", cmd
    seq.num_computed_tokens = len(prompt)
    seq.append_token(cmd[1])
    tokens = [cmd[1]]
    for _ in range(steps - 1):
        logits = core.runner.logits_for([ScheduledSeq(seq, 1)])
        tok = int(logits[-1].argmax())
        seq.num_computed_tokens += 1
        seq.append_token(tok)
        tokens.append(tok)
    conn.send(("tokens", tokens))
    tr.close()


def phase_pd_handoff() -> dict[str, Any]:
    """P->D between two processes on one GPU: this process prefills with the engine, writes the
    prompt's KV blocks straight into the decode process's reserved blocks over NIXL and sends
    the first token; the decode process's greedy tokens must equal one engine's here."""
    _need_cuda(dry_ok=True)
    _need_nixl()
    import torch
    from kvt_procs import recv_until, spawn, stop

    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.engine_core import EngineCore
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence
    from kvrelay.kv_transfer.cuda_sync import bind_thread_to, record_ready_event
    from kvrelay.kv_transfer.layout import KVLayout
    from kvrelay.kv_transfer.messages import PeerInfo
    from kvrelay.kv_transfer.nixl_transport import NixlTransport

    dev, steps = DRY_DEVICE or "cuda:0", 24
    md = model_dir("llama")
    prompt = [random.Random(9).randrange(3, 500) for _ in range(300)]
    bind_thread_to(torch.device(dev))
    core = EngineCore(EngineConfig.from_kwargs(md, device=dev, dtype="bfloat16",
                                               attention_backend=BACKEND, block_size=256,
                                               num_blocks=32, enforce_eager=True, seed=0))
    tr = NixlTransport("smoke-p", core.runner.transfer_kv,
                       KVLayout.from_spec(core.runner.kv_spec, "smoke-model",
                                          torch.device(dev).type))
    p, conn = spawn(decode_child, md, dev, "smoke-d", prompt, steps)
    try:
        _, info, remote_blocks = recv_until(conn, "ready", 120)
        peer = PeerInfo.from_bytes(info)
        tr.add_peer(peer)
        seq = Sequence("p", list(prompt), SamplingParams(max_tokens=steps, temperature=0.0))
        assert core.block_manager.allocate(seq, len(prompt) + steps)
        t0 = time.perf_counter()
        first = int(core.runner.logits_for([ScheduledSeq(seq, len(prompt))])[-1].argmax())
        if torch.device(dev).type == "cuda":
            record_ready_event(torch.device(dev)).synchronize()
        t1 = time.perf_counter()
        n = -(-len(prompt) // core.runner.kv_spec.block_size)
        tr.wait(tr.write(peer.agent_name, None, seq.block_table[:n], remote_blocks[:n]),
                timeout=30)
        tr.send_notif(peer.agent_name, b"smoke-kv-done")
        t2 = time.perf_counter()
        conn.send(("first", first))
        _, remote_tokens = recv_until(conn, "tokens", 120)
        # the same request decoded here, aggregated
        seq.num_computed_tokens = len(prompt)
        seq.append_token(first)
        local = [first]
        for _ in range(steps - 1):
            tok = int(core.runner.logits_for([ScheduledSeq(seq, 1)])[-1].argmax())
            seq.num_computed_tokens += 1
            seq.append_token(tok)
            local.append(tok)
    finally:
        stop(p, conn)
        tr.close()
    ok = remote_tokens == local
    kv_bytes = n * core.runner.kv_spec.num_layers * 2 * tr.layout.block_bytes
    return {"status": "PASS" if ok else "FAIL", "prompt_tokens": len(prompt),
            "prefill_ms": round((t1 - t0) * 1e3, 2), "kv_write_ms": round((t2 - t1) * 1e3, 2),
            "kv_bytes": kv_bytes, "tokens_equal": ok, "decode_tokens": remote_tokens[:8]}


def _prefilled(core: Any, n: int, context: int = 200) -> list[Any]:
    """``n`` sequences with ``context`` tokens of KV each (room for 60 more), ready to decode."""
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence

    rng = random.Random(0)
    seqs = []
    for i in range(n):
        s = Sequence(f"s{i}", [rng.randrange(3, 500) for _ in range(context + 60)],
                     SamplingParams())
        assert core.block_manager.allocate(s, s.num_tokens)
        core.runner.logits_for([ScheduledSeq(s, context)])
        s.num_computed_tokens = context
        seqs.append(s)
    return seqs


DECODE_SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=4, head_dim=64)


def phase_decode_steps() -> dict[str, Any]:
    """INFO: decode step time at batch 1/8/32/64, CUDA graphs vs eager, on a ~100M-parameter
    Llama (hidden 768, 12 layers) in bf16, context ~200 tokens. Attention runs through
    whichever flash-attn is installed; the stand-in pads to 1024 keys, so its numbers bound
    the real kernel's from above."""
    _need_cuda(dry_ok=True)
    import torch

    from kvrelay.engine.kv_connector import ScheduledSeq

    out: dict[str, Any] = {}
    for graphs in (True, False):
        core = _decoding_core(graphs, **DECODE_SHAPE)
        seqs = _prefilled(core, 64)
        g = core.runner.decode_graphs
        for batch in (1, 8, 32, 64):
            sched = [ScheduledSeq(s, 1) for s in seqs[:batch]]

            def step(sched: list[Any] = sched, g: Any = g, runner: Any = core.runner) -> Any:
                return g.logits(sched) if g is not None and g.handles(sched) else \
                    runner.logits_for(sched)

            sync = torch.cuda.synchronize if _cuda() else (lambda: None)
            for _ in range(3):
                step()
            sync()
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            out[f"{'graphs' if graphs else 'eager'}/B{batch}"] = {
                "step_ms": round(ms, 3), "tok_per_s": round(batch / ms * 1e3, 1)}
        del core, g, seqs
        if _cuda():
            torch.cuda.empty_cache()
    for batch in (1, 8, 32, 64):
        e, gr = out[f"eager/B{batch}"]["step_ms"], out[f"graphs/B{batch}"]["step_ms"]
        out[f"speedup/B{batch}"] = round(e / gr, 2)
    return {"status": "INFO", **out}


def phase_eager_profile() -> dict[str, Any]:
    """INFO: where an eager decode step's host time goes (cProfile over 20 steps of batch 8 on
    the decode_steps model), the 15 functions of most own time. An eager step that takes far
    longer than its kernels is host-bound: this names the Python that binds it."""
    _need_cuda(dry_ok=True)
    import cProfile
    import pstats

    import torch

    from kvrelay.engine.kv_connector import ScheduledSeq

    core = _decoding_core(False, **DECODE_SHAPE)
    seqs = _prefilled(core, 8)
    sched = [ScheduledSeq(s, 1) for s in seqs]
    sync = torch.cuda.synchronize if _cuda() else (lambda: None)
    for _ in range(3):
        core.runner.logits_for(sched)
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(20):
        core.runner.logits_for(sched)
    sync()
    prof.disable()
    step_ms = (time.perf_counter() - t0) / 20 * 1e3
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]  # type: ignore[attr-defined]
    top = [{"fn": f"{os.path.basename(f)}:{line}:{name}", "calls_per_step": round(nc / 20, 1),
            "own_ms_per_step": round(tt / 20 * 1e3, 3), "cum_ms_per_step": round(ct / 20 * 1e3, 3)}
           for (f, line, name), (_, nc, tt, ct, _) in rows]
    return {"status": "INFO", "step_ms_profiled": round(step_ms, 3), "top_own_time": top}


def phase_nccl_world1() -> dict[str, Any]:
    """A world-1 NCCL group bound to its device (``device_id``): a CUDA all-reduce works, a CPU
    tensor is refused (what kvrelay's control messages must never send), and a gloo group for
    control sits beside it."""
    _need_cuda()
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dev = torch.device("cuda:0")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=dev)
    try:
        x = torch.full((1024,), 3.0, device=dev)
        dist.all_reduce(x)
        cuda_ok = bool((x == 3.0).all())
        try:
            dist.all_reduce(torch.ones(4))
            cpu_refused = False
        except Exception as e:
            cpu_refused = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        gloo = dist.new_group(backend="gloo")
        y = torch.ones(4)
        dist.all_reduce(y, group=gloo)
        gloo_ok = bool((y == 1.0).all())
    finally:
        dist.destroy_process_group()
    shard_ok = _tp_shard_groups(dev)
    ok = cuda_ok and bool(cpu_refused) and gloo_ok and shard_ok is True
    return {"status": "PASS" if ok else "FAIL", "cuda_all_reduce": cuda_ok,
            "cpu_tensor_refused": cpu_refused, "gloo_beside": gloo_ok,
            "tp_shard_nccl_activations_gloo_control": shard_ok}


def _tp_shard_groups(dev: Any) -> bool | str:
    """kvrelay's own TP groups on a world of one (``engine/tp_shard.make_groups``): NCCL takes a
    CUDA activation, gloo the control messages, and a CPU activation is refused."""
    import datetime
    import socket

    import torch
    import torch.distributed as dist

    from kvrelay.engine.tp_shard import TensorParallelError, TPShard, make_groups

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout = datetime.timedelta(seconds=30)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timeout)
    group, control = make_groups(store, 0, 1, timeout, torch.device(dev))
    shard = TPShard(0, 1, group, timeout, control, nccl=True)
    x = torch.full((1024,), 2.0, device=dev)
    shard.all_reduce(x)
    torch.cuda.synchronize(dev)
    c = torch.tensor([5, -5])
    shard.control_all_reduce(c, dist.ReduceOp.MAX)
    shard.broadcast(c)
    try:
        shard.all_reduce(torch.ones(2))
        return "a CPU activation reached NCCL"
    except TensorParallelError:
        pass
    return bool((x == 2.0).all()) and c.tolist() == [5, -5]


# In the order they run: what a first GPU run most needs to know comes first.
PHASES: dict[str, tuple[Callable[[], dict[str, Any]], int]] = {
    "environment": (phase_environment, 90),
    "standin_vs_reference": (phase_standin_vs_reference, 60),
    "bf16_vs_transformers": (phase_bf16_vs_transformers, 120),
    "flash_vs_sdpa": (phase_flash_vs_sdpa, 120),
    "cuda_graphs": (phase_cuda_graphs, 120),
    "kv_layout": (phase_kv_layout, 90),
    "kv_sizing": (phase_kv_sizing, 90),
    "nixl_vram": (phase_nixl_vram, 120),
    "pd_handoff": (phase_pd_handoff, 120),
    "decode_steps": (phase_decode_steps, 120),
    "host_syncs": (phase_host_syncs, 90),
    "eager_profile": (phase_eager_profile, 90),
    "nccl_world1": (phase_nccl_world1, 60),
    "tp_shard_load": (phase_tp_shard_load, 60),
}


# -- the driver ----------------------------------------------------------------------------------
def run_phase(name: str, result_path: str) -> None:
    """In the phase's own process: run it and write its result as JSON."""
    fn, _ = PHASES[name]
    t0 = time.perf_counter()
    try:
        result = fn()
    except Skip as e:
        result = {"status": "SKIP", "why": str(e)}
    except BaseException as e:
        result = {"status": "FAIL", "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=2, default=str)


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvr-smoke-") as d:
        yield d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--only", default="", help="comma-separated phases (default: all)")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for all phases: no phase starts, or runs, past it")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(PHASES)
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        ap.error(f"unknown phases {unknown}; choose from {list(PHASES)}")
    os.makedirs(args.out, exist_ok=True)
    report: dict[str, Any] = {}
    failed = 0
    with _scratch() as scratch:
        env = {**os.environ, "KVRELAY_SMOKE_MODELS": os.path.join(scratch, "models"),
               "UCX_PROTO_INFO": os.environ.get("UCX_PROTO_INFO", "y")}
        start = time.monotonic()
        for name in names:
            left = args.budget - (time.monotonic() - start)
            timeout = min(PHASES[name][1], left)
            if timeout < 20:
                report[name] = {"status": "SKIP", "why": f"the {args.budget:.0f} s budget is spent"}
                sys.stdout.write(f"SKIP {name}: budget spent\n")
                continue
            path = os.path.join(scratch, f"{name}.json")
            log_path = os.path.join(args.out, f"smoke-{name}.log")
            t0 = time.perf_counter()
            with open(log_path, "w") as log, contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run([sys.executable, "-c",
                                f"import smoke; smoke.run_phase({name!r}, {path!r})"],
                               cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT,
                               timeout=timeout, check=False)
            if os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
            else:
                result = {"status": "FAIL", "error": f"no result within {timeout:.0f} s (timeout "
                          "or crash; see the log)", "seconds": round(time.perf_counter() - t0, 1)}
            report[name] = result
            failed += result["status"] == "FAIL"
            with open(os.path.join(args.out, "smoke.json"), "w") as f:
                json.dump(report, f, indent=2, default=str)
            detail = result.get("why") or result.get("error") or ""
            sys.stdout.write(f"{result['status']:4} {name} ({result.get('seconds', '?')} s)"
                             f"{': ' + detail.splitlines()[0][:200] if detail else ''}\n")
            sys.stdout.flush()
    sys.stdout.write(f"smoke: {sum(r['status'] == 'PASS' for r in report.values())} passed, "
                     f"{failed} failed, {sum(r['status'] == 'SKIP' for r in report.values())} "
                     f"skipped, {sum(r['status'] == 'INFO' for r in report.values())} info\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
