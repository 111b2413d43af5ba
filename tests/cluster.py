"""The tests' cluster: the shared loopback harness (``kvrelay.local_cluster``) with workers
sized for tests (one torch thread, a 64 MiB KV cache)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvrelay.client import sampling
from kvrelay.forking import Forked
from kvrelay.local_cluster import Cluster as LocalCluster
from kvrelay.local_cluster import Proc

__all__ = ["WORKER_ARGS", "Cluster", "Forked", "KilledStream", "Proc", "engine_alone",
           "prompt_ids"]

WORKER_ARGS = ("--num-threads", "1", "--kv-cache-memory", "64MiB")


def prompt_ids(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` ids from the tokenizer's ordinary range, the same for a ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


def engine_alone(llm: Any, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``ids`` from an offline ``LLM``: what a cluster must stream."""
    from kvrelay.engine.sampling_params import SamplingParams

    return llm.generate(ids, SamplingParams(max_tokens=n, temperature=0,
                                            ignore_eos=True))[0].token_ids


@dataclass
class KilledStream:
    """A greedy stream during which the decode worker holding it was killed."""

    tokens: list[int] = field(default_factory=list)
    killed_at: int | None = None  # tokens received when the kill was sent
    trace: list[str] = field(default_factory=list)  # the final message's trace event names
    usage: Any = None  # the final message's usage


class Cluster(LocalCluster):
    def __init__(self, *args: Any, worker_args: tuple[str, ...] = (), **kw: Any):
        super().__init__(*args, worker_args=WORKER_ARGS + tuple(worker_args), **kw)

    def live(self, role: str) -> list[Proc]:
        """The workers of ``role`` still running."""
        return [p for p in self.workers if p.name.startswith(role) and p.alive()]

    def ensure_workers(self, **counts: int) -> None:
        """Start workers until each role has its count running (a module sharing this cluster
        after another killed one of them gets it replaced), then wait until they registered."""
        for role, n in counts.items():
            for _ in range(n - len(self.live(role))):
                self.add_worker(role, wait=False)
        for p in self.workers:
            if p.alive() and p.ready is None:
                self.wait_ready(p)
        self.wait_registered()

    def stream_killing_its_decode_worker(self, ids: list[int], max_tokens: int,
                                         after: int = 10, attempts: int = 3) -> KilledStream:
        """Stream ``max_tokens`` greedy tokens of ``ids``, killing the decode worker that holds
        the stream once ``after`` tokens arrived; asserts the router migrated it (its trace
        says ``migrate``).

        On a loaded host this client can read far behind the server: a tiny model decodes 80
        tokens in ~0.3 s, and may have finished the whole stream by the time its ``after``-th
        token is read here (then no decode worker holds it, or the kill lands on a worker that
        just finished it, and the stream ends complete with no ``migrate``). Such a stream
        proves nothing either way: a killed worker is replaced and the stream run again, up to
        ``attempts`` times."""
        decodes = len(self.live("decode"))
        for _ in range(attempts):
            out = self._stream_and_kill(ids, max_tokens, after)
            if out.killed_at is not None and "migrate" in out.trace:
                return out
            # Only a stream that completed before its kill may lack a migration.
            assert len(out.tokens) == max_tokens and "finished" in out.trace, out
            if out.killed_at is not None:
                self.ensure_workers(decode=decodes)
        raise AssertionError(f"the stream outran this client {attempts} times: it finished "
                             f"before its token {after} was read here")

    def _stream_and_kill(self, ids: list[int], max_tokens: int, after: int) -> KilledStream:
        """One stream, killing the decode worker that reports a running request once ``after``
        tokens arrived (none, if no decode worker does: the stream finished already)."""
        decodes = self.live("decode")
        out = KilledStream()
        looked = False
        with self.client() as c:
            for msg in c.stream(ids, sampling(max_tokens, 0.0, ignore_eos=True), timeout=180):
                out.tokens.extend(msg.token_ids)
                if not looked and len(out.tokens) >= after:
                    looked = True
                    victim = next((p for p in decodes if self.status(p).load.running >= 1),
                                  None)
                    if victim is not None:
                        self.kill(victim)
                        out.killed_at = len(out.tokens)
                if msg.finish_reason:
                    out.trace = [e.name for e in msg.trace]
                    out.usage = msg.usage
        return out

    def openai(self, timeout: float = 120.0) -> Any:
        """An OpenAI SDK client of the router's HTTP API (started with ``--http-port``)."""
        import openai

        return openai.OpenAI(base_url=f"{self.http_url}/v1", api_key="unused", max_retries=0,
                             timeout=timeout)
