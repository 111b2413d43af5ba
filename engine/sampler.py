"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Random rows are sampled by inverting each row's CDF: one uniform draw ``u`` per row, then the
first token whose cumulative probability exceeds ``u`` times the row's total. That draws from
``p`` exactly (each token owns an interval of its probability's width, up to one float32 ulp) and
costs a cumsum and a binary search per row. The exponential race (``argmax(p / q)``,
``q ~ Exp(1)``) it replaces needed one exponential per vocabulary entry: ~8 ms a step for 16
rows of a 32k vocabulary on two CPU cores, a third of a decode step. Each request keeps its own
generator: a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvrelay.engine.grammar_mask import StepMasks, apply_masks
from kvrelay.engine.host_copy import tensor_to_device, to_device
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.engine.pointwise import argmax_rows
from kvrelay.engine.sequence import Sequence

__all__ = ["TokenLogprob", "apply_logits_processors", "sample", "seeded_generator", "skip_draw"]


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def skip_draw(generator: torch.Generator, device: torch.device) -> None:
    """Advance ``generator`` past one token's draw. A decode engine continuing a seeded request
    whose first token was sampled elsewhere does this, so the stream equals an aggregated run."""
    torch.rand(1, device=device, generator=generator)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    drop |= (cum - probs) >= top_p[:, None]  # keeps at least the first token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _token_table(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in lists), default=0)
    table = torch.full((len(lists), max(width, 1)), pad, dtype=torch.long)
    for r, t in enumerate(lists):
        if t:
            table[r, :len(t)] = torch.tensor(t, dtype=torch.long)
    return tensor_to_device(table, device)


def banned_by_bad_words(output: Seq[int], words: Seq[Seq[int]]) -> list[int]:
    """The tokens that would complete one of ``words`` after ``output``: a word's last token
    when the output ends with the rest of the word (a one-token word always). The ids are
    inside the vocabulary: ``EngineCore.validate_sampling`` refused the request otherwise."""
    banned: set[int] = set()
    n = len(output)
    for w in words:
        k = len(w) - 1
        if k <= n and (k == 0 or list(output[n - k:]) == list(w[:k])):
            banned.add(w[-1])
    return sorted(banned)


def apply_logits_processors(logits: torch.Tensor, seqs: Seq[Sequence],
                            eos_token_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """The request-level logits edits, vectorized over the rows that ask for any (vLLM order and
    semantics): ``allowed_token_ids``, ``logit_bias``, ``bad_words_token_ids`` and
    ``min_tokens`` (EOS, unless ``ignore_eos``, and ``stop_token_ids`` masked until that many
    tokens were generated), then the repetition penalty over prompt + output tokens (positive
    logits divided, negative multiplied) and the frequency/presence penalties over output
    tokens. Returns ``logits`` itself, untouched, when no row uses any of them; otherwise a
    processed copy."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.processes_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    dev = out.device
    neg_inf = float("-inf")
    for i in rows:  # sparse per-row edits: a handful of index writes each
        seq, sp = seqs[i], seqs[i].sampling
        if sp.allowed_token_ids is not None:
            keep = to_device(sorted(sp.allowed_token_ids), torch.long, dev)
            row = torch.full((vocab,), neg_inf, dtype=out.dtype, device=dev)
            row[keep] = out[i, keep]
            out[i] = row
        if sp.logit_bias:
            ids = to_device([t for t, _ in sp.logit_bias], torch.long, dev)
            vals = to_device([v for _, v in sp.logit_bias], out.dtype, dev)
            out[i, ids] += vals
        if sp.bad_words_token_ids:
            banned = banned_by_bad_words(seq.penalized_output_token_ids,
                                         sp.bad_words_token_ids)
            if banned:
                out[i, to_device(banned, torch.long, dev)] = neg_inf
        if sp.min_tokens and seq.num_output_tokens < sp.min_tokens:
            stops = set(sp.stop_token_ids)
            if not sp.ignore_eos:
                stops |= eos_token_ids
            stops = {t for t in stops if t < vocab}
            if stops:
                out[i, to_device(sorted(stops), torch.long, dev)] = neg_inf
    pen = [i for i in rows if seqs[i].sampling.repetition_penalty != 1.0
           or seqs[i].sampling.presence_penalty or seqs[i].sampling.frequency_penalty]
    if pen:
        idx = to_device(pen, torch.long, dev)
        sub = out.index_select(0, idx)
        sps = [seqs[i].sampling for i in pen]
        outputs = _token_table([seqs[i].penalized_output_token_ids for i in pen], vocab, dev)
        counts = torch.zeros((len(pen), vocab + 1), dtype=sub.dtype, device=dev)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=sub.dtype))
        counts = counts[:, :vocab]
        rep = to_device([p.repetition_penalty for p in sps], sub.dtype, dev)
        if any(p.repetition_penalty != 1.0 for p in sps):  # asked of the host, not the GPU
            prompts = _token_table([seqs[i].token_ids[:seqs[i].num_prompt_tokens] for i in pen],
                                   vocab, dev)
            seen = torch.zeros((len(pen), vocab + 1), dtype=torch.bool, device=dev)
            seen.scatter_(1, prompts, True)
            seen = seen[:, :vocab] | (counts > 0)
            r = rep[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        freq = to_device([p.frequency_penalty for p in sps], sub.dtype, dev)
        pres = to_device([p.presence_penalty for p in sps], sub.dtype, dev)
        sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(sub.dtype)
        out[idx] = sub
    return out


def sample(logits: torch.Tensor, seqs: Seq[Sequence], default_generator: torch.Generator,
           eos_token_ids: frozenset[int] = frozenset(), masks: StepMasks | None = None) \
        -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of ``logits [N, vocab]`` (row i belongs to ``seqs[i]``).

    ``masks``: the grammar bitmasks of the constrained rows, applied after the logits
    processors. Logprobs are those of the model's raw distribution (vLLM's default), before
    penalties, ``logit_bias``, grammar and temperature."""
    raw = logits.float()
    logits = apply_logits_processors(raw, seqs, eos_token_ids)
    if masks is not None:
        logits = apply_masks(logits, raw, masks)
    tokens = argmax_rows(logits)
    random_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
    cum: torch.Tensor | None = None
    if random_rows:
        dev = logits.device
        idx = to_device(random_rows, torch.long, dev)
        params = [seqs[i].sampling for i in random_rows]
        temp = to_device([p.temperature for p in params], torch.float32, dev)
        rows = logits.index_select(0, idx) / temp[:, None]
        if any(p.needs_filtering for p in params):
            top_k = to_device([p.top_k for p in params], torch.long, dev)
            top_p = to_device([p.top_p for p in params], torch.float32, dev)
            rows = _filter(rows, top_k, top_p)
        cum = rows.softmax(dim=-1).cumsum_(dim=-1)
        u = torch.rand(len(random_rows), device=logits.device, generator=default_generator)
        for j, i in enumerate(random_rows):
            seq = seqs[i]
            if seq.generator is None and seq.sampling.seed is not None:
                seq.generator = seeded_generator(seq.sampling.seed, logits.device)
            if seq.generator is not None:
                u[j] = torch.rand(1, device=logits.device, generator=seq.generator)[0]
        target = (u * cum[:, -1])[:, None]
        picked = torch.searchsorted(cum, target, right=True).squeeze_(1)
        tokens[idx] = picked.clamp_(max=cum.shape[-1] - 1)
    token_list = tokens.tolist()

    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    if want:
        _fill_logprobs(raw, want, seqs, tokens, token_list, logprobs)
    forking = [i for i, s in enumerate(seqs) if s.sampling.n > 1 and s.num_output_tokens == 0]
    if forking:
        _sample_fork_firsts(raw, cum, random_rows, forking, seqs, token_list, default_generator)
    return token_list, logprobs


def _fill_logprobs(raw: torch.Tensor, want: list[int], seqs: Seq[Sequence], tokens: torch.Tensor,
                   token_list: list[int], logprobs: list[TokenLogprob | None]) -> None:
    """The sampled tokens' logprobs and top alternatives of the rows ``want``, batched: one
    log-softmax, one gather and one top-k (at the largest k asked) for all of them, read back
    in one transfer (per-row reads would each wait for the device)."""
    dev = raw.device
    idx = to_device(want, torch.long, dev)
    lp = raw.index_select(0, idx).log_softmax(-1)
    chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0].tolist()
    k = max(seqs[i].sampling.logprobs or 0 for i in want)
    vals: list[list[float]] = [[] for _ in want]
    ids: list[list[int]] = [[] for _ in want]
    if k:
        top_v, top_i = lp.topk(k, dim=-1)
        vals, ids = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        n = seqs[i].sampling.logprobs or 0
        logprobs[i] = TokenLogprob(token_list[i], chosen[j],
                                   list(zip(ids[j][:n], vals[j][:n], strict=True)))


def _sample_fork_firsts(raw: torch.Tensor, cum: torch.Tensor | None, random_rows: list[int],
                        forking: list[int], seqs: Seq[Sequence], token_list: list[int],
                        default_generator: torch.Generator) -> None:
    """The first tokens of choices 1..n-1 of an ``n > 1`` request, from the same distribution
    as choice 0's: choice ``k`` draws what a request of seed ``seed + k`` draws first (the
    unseeded draw from the engine's generator). Stored in ``seq.fork_firsts``."""
    dev = raw.device
    for i in forking:
        seq = seqs[i]
        sp = seq.sampling
        picks: list[int] = []
        for k in range(1, sp.n):
            if sp.greedy:
                picks.append(token_list[i])
                continue
            assert cum is not None
            row = cum[random_rows.index(i)]
            if sp.seed is not None:
                g = seeded_generator(sp.choice(k).seed or 0, dev)
                u = torch.rand(1, device=dev, generator=g)
            else:
                u = torch.rand(1, device=dev, generator=default_generator)
            t = torch.searchsorted(row, (u * row[-1]), right=True)
            picks.append(int(t.clamp_(max=row.shape[-1] - 1)[0]))
        lps: list[TokenLogprob | None] = [None] * len(picks)
        if sp.logprobs is not None:
            lp = raw[i].log_softmax(-1)
            top: list[tuple[int, float]] = []
            if sp.logprobs:
                vals, ids = lp.topk(sp.logprobs)
                top = list(zip(ids.tolist(), vals.tolist(), strict=True))
            lps = [TokenLogprob(t, float(lp[t]), top) for t in picks]
        seq.fork_firsts = list(zip(picks, lps, strict=True))
