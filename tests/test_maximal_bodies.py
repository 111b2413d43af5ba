"""Concurrent maximal bodies against the router's memory limit (issue 54: "concurrent maximal
bodies leave the router's RSS under its limit and every request answered (200/400/413/429)").

The session's shared cluster (``api_fixtures``): its router is a process of its own, whose
resident memory is read from ``/proc/<pid>/status`` (VmRSS sampled every 10 ms, and VmHWM, its
peak, reset first where the kernel lets us).

Found here, and fixed: a body carrying the largest prompt the router takes (4 Mi characters,
each a 6-byte JSON escape: 24 MiB) was parsed and then tokenized whole before it was found too
long for the context, and the tokenization alone cost ~1.2 GiB (the fast tokenizer's encoding
of millions of tokens, and their ids as Python ints). Admission lets two such bodies in at once
(its byte budget is two maximal bodies): measured, the router went from 95 MiB to 2.5 GiB, past
the manifests' 2 GiB limit (an OOM kill on Kubernetes). The router now counts a long text's
tokens a chunk at a time before encoding it (``RouterService._tokens_at_least``) and refuses it
once the count passes the context.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import api_fixtures
import httpx
import pytest
from fuzz_support import check_still_serving, http_client

from kvrelay.common.limits import MAX_HTTP_BODY_BYTES, MAX_PROMPT_CHARS
from kvrelay.router.admission import MAX_ADMITTING_BYTES

pytestmark = pytest.mark.slow

cluster = api_fixtures.cluster

ROUTER_MEMORY_LIMIT_KIB = 2 * 1024 * 1024  # the router's limit in the manifests: 2Gi
# What one body admitted for parsing may cost, in its own bytes: a parsed body is up to ~15x
# its bytes in Python objects (admission.py); its prompt's tokens come on top.
PER_BODY_FACTOR = 16


def _memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (its peak) of process ``pid``, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


def test_concurrent_maximal_bodies_stay_under_the_memory_limit(cluster) -> None:
    """Four of the largest prompt a body can carry at once, with one body a byte over the limit
    (413 by its length), then a maximal body of numbers (refused by its value count before it
    is parsed). Every one is answered 400, 413 or 429 (admission holds two maximal bodies'
    bytes) with a message, and the router's resident memory stays under idle + 16x the bytes
    admission lets in at once (what two parsed bodies may cost) and under the manifests' 2 GiB;
    the cluster still serves afterwards."""
    pid = cluster.router.popen.pid
    try:  # reset the peak to the current RSS, so VmHWM is this test's
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    idle = _memory_kib(pid)["VmRSS"]
    head = b'{"model": "demo", "max_tokens": 2, "prompt": "'
    escaped = head + b"\\u00e9" * MAX_PROMPT_CHARS + b'"}'
    assert len(escaped) <= MAX_HTTP_BODY_BYTES
    over = head + b"a" * (MAX_HTTP_BODY_BYTES - len(head) - 1) + b'"}'
    assert len(over) == MAX_HTTP_BODY_BYTES + 1
    n_ids = (MAX_HTTP_BODY_BYTES - 1024) // 5
    numbers = b'{"model":"demo","max_tokens":2,"prompt":[' + b",".join([b"1000"] * n_ids) + b"]}"

    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(_memory_kib(pid)["VmRSS"])
            done.wait(0.01)

    with http_client(cluster) as http:
        def post(body: bytes) -> httpx.Response:
            with httpx.Client(base_url=http.base_url, timeout=300) as c:
                return c.post("/v1/completions", content=body,
                              headers={"content-type": "application/json"})

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with ThreadPoolExecutor(5) as pool:
                answers = list(pool.map(post, [escaped] * 4 + [over]))
            answers.append(post(numbers))
        finally:
            done.set()
            sampler.join(5)
        peak = max(samples + [_memory_kib(pid)["VmHWM"] if reset else 0])
        statuses = [r.status_code for r in answers]
        print(f"router RSS: idle {idle // 1024} MiB, peak {peak // 1024} MiB (VmHWM reset: "
              f"{reset}); answers {statuses}")
        for r in answers:
            assert r.status_code in (200, 400, 413, 429, 503), (statuses, r.text[:300])
            assert r.json()["error"]["message"], r.text[:300]
        assert statuses[4:] == [413, 400], statuses
        assert 400 in statuses[:4], statuses  # a maximal prompt was parsed and tokenized
        bound = min(idle + PER_BODY_FACTOR * MAX_ADMITTING_BYTES // 1024,
                    ROUTER_MEMORY_LIMIT_KIB)
        assert peak < bound, (f"peak {peak // 1024} MiB, bound {bound // 1024} MiB "
                              f"(idle {idle // 1024} MiB)", statuses)
        check_still_serving(cluster, http)
