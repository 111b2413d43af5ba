"""A small gRPC client of kvrelay.v1 (used by ``kvrelay generate``, tests and benchmarks)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from kvrelay.common.rpc import CHANNEL_OPTIONS
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import generate_pb2_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_ERROR: "error"}


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    usage: pb.Usage | None = None
    timing: pb.Timing | None = None
    trace: list[pb.TraceEvent] = field(default_factory=list)
    num_messages: int = 0


def sampling(max_tokens: int = 16, temperature: float = 0.0, **kw: object) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                             **{k: v for k, v in kw.items() if v is not None})


class Client:
    def __init__(self, target: str, *, api_key: str | None = None, tls_ca: str | None = None):
        if tls_ca:
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, prompt: str | list[int], params: pb.SamplingParams | None = None, *,
               request_id: str = "", timeout: float | None = None,
               timeout_ms: int = 0, cache_salt: str = "") -> Iterator[pb.GenerateResponse]:
        """``cache_salt``: the prefix-cache namespace (requests share cached blocks only with
        requests of the same salt)."""
        req = pb.GenerateRequest(request_id=request_id, sampling=params or sampling(),
                                 timeout_ms=timeout_ms, cache_salt=cache_salt)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return self.stub.Generate(req, metadata=self.metadata, timeout=timeout)

    def generate(self, prompt: str | list[int], params: pb.SamplingParams | None = None,
                 **kw: object) -> Completion:
        out = Completion()
        for msg in self.stream(prompt, params, **kw):  # type: ignore[arg-type]
            out.num_messages += 1
            out.request_id = msg.request_id
            if msg.HasField("usage"):  # the request's last message (of any choice)
                out.usage, out.timing = msg.usage, msg.timing
                out.trace = list(msg.trace)
            if msg.index:  # n > 1: this joins choice 0; ``stream`` has them all
                continue
            out.text += msg.text
            out.token_ids.extend(msg.token_ids)
            if msg.finish_reason:
                out.finish_reason = FINISH_NAMES.get(msg.finish_reason)
                out.stop_reason = msg.stop_reason
        return out


def generate_cli(args: argparse.Namespace) -> int:
    params = sampling(args.max_tokens, args.temperature, top_p=args.top_p, top_k=args.top_k,
                      seed=args.seed)
    params.stop.extend(args.stop)
    with Client(args.target, api_key=args.api_key, tls_ca=args.tls_ca) as c:
        try:
            last = None
            for msg in c.stream(args.prompt, params, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                last = msg
        except grpc.RpcError as e:
            sys.stdout.write("\n")
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        if args.show_stats and last is not None:
            u, t = last.usage, last.timing
            print(f"[{FINISH_NAMES.get(last.finish_reason)}] prompt={u.prompt_tokens} "
                  f"completion={u.completion_tokens} cached={u.cached_prompt_tokens} "
                  f"ttft={t.ttft_ms:.1f}ms e2e={t.e2e_ms:.1f}ms itl={t.mean_itl_ms:.1f}ms",
                  file=sys.stderr)
    return 0
