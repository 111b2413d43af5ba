"""The native library's ABI has one source (``engine/cpu/csrc/abi.h``), and its build targets an ISA
level, not the build host: the ctypes structs of ``cpu/fused_decode.py`` equal the header's
declarations (names, order, types, compiled offsets), the version Python checks is the header's,
and a forced ISA level is built and used, or refused where the CPU lacks it."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.engine.cpu import native
from kvrelay.engine.cpu.fused_decode import _Layer, _Step

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "engine" / "cpu" / "csrc" / "abi.h"
KIND = {ctypes.c_void_p: "ptr", ctypes.c_int64: "i64", ctypes.c_float: "f32", ctypes.c_int: "int"}
C_KIND = {"int64_t": "i64", "float": "f32", "int": "int"}


def header_struct(name: str) -> list[tuple[str, str]]:
    """``[(field, kind)]`` of ``typedef struct {...} name;`` in abi.h, declaration order."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + name + ";", text)
    assert body, name
    fields: list[tuple[str, str]] = []
    for decl in body.group(1).split(";"):
        decl = decl.strip()
        if not decl:
            continue
        m = re.match(r"(?:const\s+)?(\w+)\s+(.*)", decl, re.S)
        assert m, decl
        base, names = m.groups()
        for n in names.split(","):
            n = n.strip()
            fields.append((n.lstrip("*").strip(), "ptr" if n.startswith("*") else C_KIND[base]))
    return fields


@pytest.mark.parametrize("cls,name", [(_Layer, "kvr_layer_t"), (_Step, "kvr_step_t")])
def test_ctypes_structs_are_the_headers(cls: type[ctypes.Structure], name: str) -> None:
    ours = [(f, KIND[t]) for f, t in cls._fields_]
    assert ours == header_struct(name)


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")
def test_ctypes_offsets_are_the_compilers(tmp_path: Path) -> None:
    lines = []
    for cls, name in ((_Layer, "kvr_layer_t"), (_Step, "kvr_step_t")):
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        lines += [f'printf("{name}.{f} %zu\\n", offsetof({name}, {f}));' for f, _ in cls._fields_]
    src = tmp_path / "offsets.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "abi.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "offsets"
    subprocess.run([os.environ.get("CC") or "cc", "-I", str(HEADER.parent), "-o", str(exe),
                    str(src)], check=True, capture_output=True, timeout=60)
    got = dict(line.split() for line in subprocess.run(
        [str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout.splitlines())
    for cls, name in ((_Layer, "kvr_layer_t"), (_Step, "kvr_step_t")):
        assert int(got[name]) == ctypes.sizeof(cls), name
        for f, _ in cls._fields_:
            assert int(got[f"{name}.{f}"]) == getattr(cls, f).offset, (name, f)


def test_the_abi_version_is_the_headers_and_the_librarys() -> None:
    assert native.abi_version() == int(re.search(r"#define KVR_ABI_VERSION (\d+)",
                                                 HEADER.read_text()).group(1))
    lib = native.load()
    if lib is None:
        pytest.skip("native kernels unavailable here")
    assert lib.kvr_abi_version() == native.abi_version()


V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "sse4_2"})
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.skipif(native.isa_levels() != native.X86_LEVELS, reason="x86-64 levels")
def test_the_best_level_the_cpu_has_is_picked() -> None:
    assert native.pick_isa(V4, "").name == "avx512"
    assert native.pick_isa(V3, "").name == "avx2"
    assert native.pick_isa(frozenset({"sse2"}), "").name == "x86-64"
    assert native.pick_isa(V4, "avx2").name == "avx2"


@pytest.mark.skipif(native.isa_levels() != native.X86_LEVELS, reason="x86-64 levels")
def test_a_forced_level_the_cpu_lacks_is_refused_not_run() -> None:
    with pytest.raises(RuntimeError, match="lacks avx512bw, avx512cd, avx512dq, avx512f"):
        native.pick_isa(V3, "avx512")
    with pytest.raises(RuntimeError, match="not an ISA level"):
        native.pick_isa(V4, "sse9")


@pytest.mark.slow
@pytest.mark.skipif(native.isa_levels() != native.X86_LEVELS
                    or not set(native.X86_LEVELS[1].needs) <= native.cpu_flags(),
                    reason="needs an AVX2 x86-64 CPU")
def test_forcing_avx2_builds_and_loads_the_avx2_library_with_the_same_results() -> None:
    """What a CPU without AVX-512 gets, forced on this one: the avx2 build, and panel GEMM
    results equal to torch's."""
    code = (
        "import torch\n"
        "from kvrelay.engine.cpu import gemm, native\n"
        "assert native.load() is not None, 'no native library'\n"
        "print(native.library_name())\n"
        "torch.manual_seed(0)\n"
        "w, x = torch.randn(96, 200), torch.randn(5, 200)\n"
        "y = gemm.panel_linear(x, gemm.pack_panels(w, 0), None, 96, 1, 0)\n"
        "print(float((y - x @ w.T).abs().max()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True,
                         env={**os.environ, native.ISA_ENV: "avx2"}).stdout.split()
    assert out[0].startswith("kvrelay_kernels_avx2_"), out
    assert float(out[1]) < 1e-4
