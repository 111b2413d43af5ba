"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

They come from the hidden states of the prompt's own rows in the steps that prefill it, so they
cost no extra forward: only the logits of those rows (of the sequences that ask), which a step
otherwise never computes (it samples from each sequence's last row only).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sampler import TokenLogprob
from kvrelay.engine.step_inputs import row_order

# Prompt rows whose logits are computed at once: fp32 logits of every row of an 8192-token chunk
# on a 152k vocabulary were ~12 GB (and their log_softmax as much again), and an out-of-memory
# there fails every request in the step. 256 rows of that vocabulary: ~160 MB.
ROWS_PER_CHUNK = 256


def record_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                           scheduled: Seq[ScheduledSeq], hidden: torch.Tensor) -> None:
    """For sequences that ask for prompt logprobs: the logits of this step's prompt rows
    (only theirs, from ``hidden`` in ``row_order``), scored against the next prompt token, into
    ``seq.prompt_logprobs``."""
    if not any(s.seq.sampling.prompt_logprobs is not None for s in scheduled):
        return
    prefill, decode = row_order(scheduled)
    off = 0
    for i in prefill + decode:
        seq, n = scheduled[i]
        c = seq.num_computed_tokens
        k = seq.sampling.prompt_logprobs
        end = min(c + n, seq.num_prompt_tokens - 1)  # row p scores prompt token p + 1
        if k is not None and end > c:
            chosen: list[float] = []
            tops: list[list[tuple[int, float]]] = []
            for a in range(c, end, ROWS_PER_CHUNK):  # rows a..b-1 score tokens a+1..b
                b = min(end, a + ROWS_PER_CHUNK)
                lp = compute_logits(hidden[off + a - c:off + b - c]).float().log_softmax(-1)
                target = torch.tensor(seq.token_ids[a + 1:b + 1], dtype=torch.long,
                                      device=lp.device)
                chosen += lp.gather(1, target[:, None])[:, 0].tolist()
                if k:
                    vals, ids = lp.topk(k, dim=-1)
                    tops += [list(zip(r_ids, r_vals, strict=True))
                             for r_ids, r_vals in zip(ids.tolist(), vals.tolist(), strict=True)]
                else:
                    tops += [[] for _ in range(b - a)]
                del lp
            del seq.prompt_logprobs[c:]  # a recompute (preemption) starts over
            seq.prompt_logprobs.extend(
                TokenLogprob(t, v, top) for t, v, top in
                zip(seq.token_ids[c + 1:end + 1], chosen, tops, strict=True))
        off += n
