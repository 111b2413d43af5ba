"""Decode throughput with a JSON schema active vs without, at one batch size (EngineCore alone).

Every request of a batch is prefilled first; then the decode steps are timed until all end.
Both modes generate the same number of tokens: ``ignore_eos`` and a schema (an array of
``--max-tokens`` one-digit integers) that cannot end sooner. Three modes, interleaved over
``--rounds``: free text, schema with the masks filled on a thread beside the forward (the
engine's default), and schema with the masks filled inline before sampling. Mask fill time
(inline mode) is reported per step.

    .venv/bin/python -m bench.engine.structured --model /tmp/tiny7 --batch 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.grammar_mask import MaskFiller
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured import StructuredOutput
from kvrelay.engine.tokenizer import eos_token_ids, load_tokenizer


class _TimedFiller(MaskFiller):
    """Inline filling (on as many llguidance workers as torch threads, as the engine does),
    timed."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size, overlap=False, threads=torch.get_num_threads())
        self.seconds: list[float] = []

    def start(self, seqs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = super().start(seqs)
        if out is not None:
            self.seconds.append(time.perf_counter() - t)
        return out


def decode_rate(core: EngineCore, prompts: list[list[int]], sp: SamplingParams,
                tag: str) -> tuple[float, float]:
    """Decode tokens per second of one batch (the steps after every request has its first
    token), by the wall clock and per CPU second of this process (all its threads): on a
    shared machine the second varies less with what else runs."""
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, sp)
    started: set[str] = set()
    while len(started) < len(prompts):
        for o in core.step():
            if o.new_token_ids:
                started.add(o.request_id)
    tokens = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while core.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/tiny7")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); fewer than the cores leaves one "
                    "for the mask thread, and keeps OpenMP from spinning on a shared machine")
    args = ap.parse_args()

    tok = load_tokenizer(args.model)
    core = EngineCore(EngineConfig.from_kwargs(args.model, num_blocks=2048, seed=0,
                                               max_num_seqs=max(args.batch, 64),
                                               num_threads=args.threads),
                      eos_token_ids=eos_token_ids(args.model, tok))
    n = args.max_tokens
    schema = {"type": "object", "properties": {"xs": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": n, "maxItems": n}}, "required": ["xs"], "additionalProperties": False}
    so = StructuredOutput.json_schema(schema)
    free = SamplingParams(max_tokens=n, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=n, temperature=1.0, seed=0, ignore_eos=True,
                                 structured=so)
    t = time.perf_counter()
    core.grammar.check(so)
    compile_ms = (time.perf_counter() - t) * 1e3
    prompts = [tok.encode(f"Request {i}: list some digits") for i in range(args.batch)]
    runner = core.runner
    threaded = MaskFiller(runner.arch.vocab_size, overlap=True)
    timed = _TimedFiller(runner.arch.vocab_size)
    default = runner.masks
    decode_rate(core, prompts, free, "warm")  # oneDNN shapes, allocator
    rates: dict[str, list[tuple[float, float]]] = {"free text": [], "json schema (thread)": [],
                                     "json schema (inline)": []}
    for r in range(args.rounds):
        rates["free text"].append(decode_rate(core, prompts, free, f"f{r}"))
        runner.masks = threaded
        rates["json schema (thread)"].append(decode_rate(core, prompts, constrained, f"t{r}"))
        runner.masks = timed
        rates["json schema (inline)"].append(decode_rate(core, prompts, constrained, f"i{r}"))
    runner.masks = default

    base = statistics.median(w for w, _ in rates["free text"])
    cbase = statistics.median(c for _, c in rates["free text"])
    print(f"# model {args.model}; batch {args.batch}; {n} tokens each; {torch_threads()} torch "
          f"threads; load average {os.getloadavg()[0]:.2f}; median of {args.rounds} rounds")
    print(f"# the engine's default here: {'thread' if default.overlap else 'inline'}")
    print(f"# schema compile {compile_ms:.1f} ms (first, uncached); mask fill for {args.batch} "
          f"rows: median {statistics.median(timed.seconds) * 1e3:.3f} ms/step, p90 "
          f"{sorted(timed.seconds)[int(0.9 * len(timed.seconds))] * 1e3:.3f} ms")
    print(f"{'mode':>24}  {'decode tok/s':>12}  {'vs free':>8}  {'tok/CPU-s':>9}  "
          f"{'vs free':>8}  rounds (tok/s)")
    for mode, rs in rates.items():
        med = statistics.median(w for w, _ in rs)
        cmed = statistics.median(c for _, c in rs)
        print(f"{mode:>24}  {med:12.1f}  {med / base:7.2f}x  {cmed:9.1f}  {cmed / cbase:7.2f}x  "
              + " ".join(f"{w:.0f}" for w, _ in rs))
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    raise SystemExit(main())
