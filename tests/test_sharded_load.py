"""A tensor-parallel rank loads its shard without ever holding the whole model (issue 53): the
loader cuts the model before it reads anything (``tp_shard.shard_model`` with ``weights.Cuts``:
each cut parameter an empty shard, the whole ones allocated untouched and never written) and
copies each checkpoint tensor's kept part into the shards, so a rank's memory grows by its
shard plus the one tensor being read, not by the model (a 70B bf16 model is 141 GB: every rank
of TP=8 held all of it before), nor by a whole layer (as when each layer was cut once loaded).

Measured in fresh processes (the peak of their anonymous memory during the load) on a bf16
Llama of two wide layers (a layer several times its largest tensor, so holding a layer shows):
rank 0 of TP=2 against the whole model loaded alone."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from hf_models import make_hf_model

from kvrelay.engine.loader import iter_checkpoint

HIDDEN, INTER, LAYERS, VOCAB = 1024, 4096, 2, 4096

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


def layer_of(name: str) -> int | None:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return None if m is None else int(m.group(1))


def test_a_tp2_rank_holds_its_shard_and_one_tensor_never_a_layer(model_dir: str) -> None:
    layer_bytes: dict[int, int] = {}
    other = one_tensor = 0
    for name, t in iter_checkpoint(model_dir):
        layer = layer_of(name)
        n = t.numel() * t.element_size()
        one_tensor = max(one_tensor, n)
        if layer is None:
            other += n  # the embedding, the final norm (the head is tied or whole): not cut
        else:
            layer_bytes[layer] = layer_bytes.get(layer, 0) + n
    assert len(layer_bytes) == LAYERS
    layers = sum(layer_bytes.values())
    one_layer = max(layer_bytes.values())
    slack = 4 * 2**20  # the allocator's arenas, torch's own small buffers
    assert one_layer > one_tensor + slack  # so a layer held whole would break the bound
    full, tp2 = grown(model_dir, 1), grown(model_dir, 2)
    assert full > layers, (full, layers)  # the measure sees the weights at all
    bound = other + layers // 2 + one_tensor + slack
    assert tp2 < bound, (tp2 / 2**20, bound / 2**20)
