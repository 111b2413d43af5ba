"""A tensor-parallel rank loads its shard without ever holding the whole model (issue 53): the
loader reads the checkpoint layer by layer (``loader.iter_checkpoint``) and cuts each decoder
layer as soon as its last tensor is in (``tp_shard.shard_layer``), and the model's parameters
are allocated untouched, so a rank's memory grows by its shard plus one whole layer at most,
not by the model (a 70B bf16 model is 141 GB: every rank of TP=8 held all of it before).

Measured in fresh processes (the peak of their anonymous memory during the load) on a
~100M-parameter bf16 Llama of 8 layers: rank 0 of TP=2 against the whole model loaded alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hf_models import make_hf_model

from kvrelay.engine.loader import iter_checkpoint, layer_of

HIDDEN, INTER, LAYERS, VOCAB = 1024, 2816, 8, 4096

# The peak of the process's anonymous memory (RssAnon: what the parameters take; the
# checkpoint's mapped file pages are page cache, counted in RSS but shared and reclaimable),
# sampled every half millisecond on a thread while the load runs, over its value before. A
# sampled peak can only be lower than the true one: the bound below is checked loosely, but a
# whole model held for the rest of a load is never missed.
LOAD = """
import datetime, sys, threading, time, torch
from kvrelay.engine.loader import load_model
from kvrelay.engine.tp_shard import TPShard

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

class Dense:  # the loader alone: no platform packing the linears for its kernels after it
    def prepare_model(self, model, dtype):
        model.fused_decode = None
        return "dense"

torch.zeros(1) @ torch.zeros(1)  # torch's own start-up, before the baseline
size = int(sys.argv[2])
shard = None if size == 1 else TPShard(rank=0, size=size, group=None,
                                         timeout=datetime.timedelta(seconds=5))
before = anon()
peak, done = [before], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)

t = threading.Thread(target=sample)
t.start()
model, _ = load_model(sys.argv[1], device=torch.device("cpu"), dtype=torch.bfloat16,
                      attn_fn=None, max_positions=256, shard=shard, platform=Dense())
done.set()
t.join()
print(max(peak[0], anon()) - before)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_hf_model(str(tmp_path_factory.mktemp("sharded") / "m"), "llama",
                         dtype=torch.bfloat16, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, vocab_size=VOCAB)


def grown(model_dir: str, tp: int) -> int:
    out = subprocess.run([sys.executable, "-c", LOAD, model_dir, str(tp)], capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    return int(out[-1])


def test_a_tp2_rank_holds_its_shard_and_one_layer_never_the_model(model_dir: str) -> None:
    layer_bytes = {}
    other = 0
    for name, t in iter_checkpoint(model_dir):
        layer = layer_of(name)
        n = t.numel() * t.element_size()
        if layer is None:
            other += n  # the embedding, the final norm (the head is tied or whole): not cut
        else:
            layer_bytes[layer] = layer_bytes.get(layer, 0) + n
    assert len(layer_bytes) == LAYERS
    layers = sum(layer_bytes.values())
    one_layer = max(layer_bytes.values())
    full, tp2 = grown(model_dir, 1), grown(model_dir, 2)
    slack = 40 * 2**20  # the allocator's arenas, a layer cut while the next one is read
    assert full > layers, (full, layers)  # the measure sees the weights at all
    bound = other + layers // 2 + one_layer + slack
    assert tp2 < bound, (tp2 / 2**20, bound / 2**20)
    assert tp2 < full - layers // 4, ("the whole model was held", tp2 / 2**20, full / 2**20)


def test_the_checkpoint_is_read_layer_after_layer(model_dir: str) -> None:
    order = [layer_of(name) for name, _ in iter_checkpoint(model_dir)]
    seen = [x for x in order if x is not None]
    assert order[:order.index(0)] == [None] * order.index(0)  # what no layer holds, first
    assert seen == sorted(seen)
