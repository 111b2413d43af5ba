"""Servicers only translate (issue 50): every gRPC servicer of the workers subclasses its
generated base alone (no mixin sharing logic), and each of its methods is a short translation:
protobuf in, one call of the service below, protobuf out. The logic (leases, sessions,
transfers, peers) lives in the service classes, which hold no gRPC context."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICER_FILES = ("prefill_worker/servicer.py", "decode_worker/servicer.py", "worker/process.py")
SERVICE_FILES = ("prefill_worker/service.py", "decode_worker/service.py")
MAX_METHOD_LINES = 25


def _servicers() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for rel in SERVICER_FILES:
        tree = ast.parse((ROOT / rel).read_text())
        out += [(rel, node) for node in tree.body
                if isinstance(node, ast.ClassDef) and node.name.endswith("Servicer")]
    return out


def test_servicers_subclass_their_generated_base_only() -> None:
    base = {"PrefillServicer": "PrefillWorkerServicer", "DecodeServicer": "DecodeWorkerServicer",
            "ControlServicer": "WorkerControlServicer"}
    found = _servicers()
    assert {c.name for _, c in found} == set(base)
    for rel, cls in found:
        bases = [ast.unparse(b) for b in cls.bases]
        assert bases == [f"worker_pb2_grpc.{base[cls.name]}"], (rel, cls.name, bases)


def test_servicer_methods_are_short_translations() -> None:
    for rel, cls in _servicers():
        for fn in cls.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
                assert n <= MAX_METHOD_LINES, f"{rel}: {cls.name}.{fn.name} has {n} lines"


def test_services_hold_no_grpc_context() -> None:
    """A service refuses with CallRefused; only its servicer aborts a call."""
    for rel in SERVICE_FILES:
        text = (ROOT / rel).read_text()
        assert "ServicerContext" not in text and "context.abort" not in text, rel
