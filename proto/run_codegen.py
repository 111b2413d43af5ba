"""Regenerate the committed protobuf/gRPC stubs from the .proto files beside this script.

Usage: python proto/run_codegen.py [--check]

The stubs import each other as ``kvrelay.proto.<name>_pb2`` (the package's import name), so
protoc sees the .proto files under the virtual path ``kvrelay/proto/``. ``--check`` writes
nothing and exits 1 when a committed stub differs from what protoc would generate now.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ("generate.proto", "worker.proto")


def generated_names() -> list[str]:
    names = []
    for p in PROTOS:
        stem = p[:-len(".proto")]
        names += [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]
    return names


def generate(out_dir: str) -> None:
    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as src:
        pkg = os.path.join(src, "kvrelay", "proto")
        os.makedirs(pkg)
        for p in PROTOS:
            shutil.copy(os.path.join(HERE, p), pkg)
        with tempfile.TemporaryDirectory() as gen:
            include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
            args = ["protoc", f"-I{src}", f"-I{include}", f"--python_out={gen}",
                    f"--pyi_out={gen}", f"--grpc_python_out={gen}"]
            args += [os.path.join("kvrelay", "proto", p) for p in PROTOS]
            if protoc.main(args) != 0:
                raise SystemExit("protoc failed")
            for name in generated_names():
                shutil.copy(os.path.join(gen, "kvrelay", "proto", name), out_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = ap.parse_args()
    if not args.check:
        generate(HERE)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        stale = [n for n in generated_names()
                 if not os.path.exists(os.path.join(HERE, n))
                 or not filecmp.cmp(os.path.join(tmp, n), os.path.join(HERE, n), shallow=False)]
    if stale:
        print("stale generated stubs: " + ", ".join(stale) + "; run `make proto`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
