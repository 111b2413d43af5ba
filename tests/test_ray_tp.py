"""Tensor-parallel pools through ``kvrelay serve`` on a real local Ray: ``--prefill-tp 2
--decode-tp 1`` and the reverse, each a second deployment (``--name``) beside the session's
(conftest's ``ray_served``, left running), started as the CLI starts one.

Each TP replica is one actor whose rank processes it starts itself (one placement-group bundle of
every rank's CPUs), each rank with its own NIXL agent; the TP=1 side runs in KV head groups, so
the KV moves rank to rank (``ServeSpec.kv_head_groups``). Requests go over gRPC to the
deployment's own router. Every wait is a bounded poll; nothing asserts timing.
"""

from __future__ import annotations

import random

import pytest
from ray_harness import Served, assert_no_leaked_blocks, prompt_ids, serve_args

from kvrelay.client import Client, sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
GEN = 12


@pytest.fixture(scope="module")
def want(demo_model_dir) -> dict[int, tuple[list[int], list[int]]]:
    """Prompt length -> (prompt, the engine alone's greedy tokens)."""
    llm = LLM(demo_model_dir, num_blocks=256, num_threads=1)
    rng = random.Random(7)
    out = {}
    for n in (5, 40, 130):
        ids = prompt_ids(n, rng)
        out[n] = (ids, llm.generate(ids, SamplingParams(max_tokens=GEN, temperature=0,
                                                         ignore_eos=True))[0].token_ids)
    return out


def test_a_deployment_name_prefixes_its_ray_names_and_must_be_a_plain_label(
        demo_model_dir, capsys) -> None:
    """The default deployment keeps the names it always had; another ``--name`` prefixes its
    controller, router and replicas (actors and placement groups); a name Ray or a reader
    would trip on is refused when the command line is parsed, naming what is allowed."""
    from kvrelay.cli import build_parser
    from kvrelay.deploy.launcher import controller_name, replica_actor_name, router_name
    from kvrelay.deploy.ray_cli import build_spec

    assert (controller_name(), router_name(), replica_actor_name("decode-2")) == \
        ("kvrelay-controller", "kvrelay-router", "kvrelay-decode-2")
    assert replica_actor_name("prefill-1", "llama-70b") == "llama-70b-prefill-1"
    assert build_spec(serve_args(demo_model_dir), loopback=True).name == "kvrelay"
    assert build_spec(serve_args(demo_model_dir, "--name", "m2"), loopback=True).name == "m2"
    for bad in ("Upper", "under_score", "-lead", "trail-", "", "x" * 41):
        for cmd in (["serve", "--model", demo_model_dir], ["status"], ["scale"]):
            with pytest.raises(SystemExit):
                build_parser().parse_args([*cmd, f"--name={bad}"])
            assert "lowercase letters, digits and inner dashes" in capsys.readouterr().err


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["p2-d1", "p1-d2"])
def test_a_tp_deployment_beside_another_serves_the_engine_alone_tokens(
        ray_served, ray_session, demo_model_dir, want, p_tp: int, d_tp: int) -> None:
    from kvrelay.deploy.launcher import connect, start
    from kvrelay.deploy.ray_cli import build_spec

    name = f"tp-p{p_tp}-d{d_tp}"
    spec = build_spec(serve_args(demo_model_dir, "--name", name, "--prefill-tp", str(p_tp),
                                 "--decode-tp", str(d_tp)), loopback=True)
    assert (spec.pools["prefill"].tp, spec.pools["decode"].tp) == (p_tp, d_tp)
    handle, info = start(spec)
    try:
        served = Served(handle, info, ray_session.get_runtime_context().gcs_address,
                        spec.worker.cluster_token)
        # Named apart from the session's deployment, which still runs and answers as itself.
        assert {r["actor"] for r in served.replicas().values()} == \
            {f"{name}-prefill-1", f"{name}-decode-1"}
        assert connect(name).status()["router"]["port"] == info["port"] != \
            connect().status()["router"]["port"]
        assert ray_served.counts() == {"prefill": 1, "decode": 1, "both": 0}
        with pytest.raises(RuntimeError, match=f"deployment '{name}' is already running"):
            start(spec)
        with pytest.raises(RuntimeError, match=f"running here: kvrelay, {name} \\(pick one"):
            connect("absent")
        with Client(served.target) as c:
            for n, (ids, tokens) in want.items():
                got = c.generate(ids, sampling(GEN, 0.0, ignore_eos=True))
                assert got.token_ids == tokens, f"P={p_tp} D={d_tp}, prompt of {n} tokens"
                names = [e.name for e in got.trace]
                assert "received" in names and "prefill_end" in names, names
        assert_no_leaked_blocks(served)
    finally:
        handle.shutdown()
