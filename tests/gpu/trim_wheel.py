"""Trim the NIXL CUDA wheel to what the GPU smoke loads, so it travels to a bare GPU machine.

``nixl-cu13`` 1.5.1 is a 59 MB wheel (238 MB unpacked): the expert-parallel kernels for three
torch versions, object-store and cloud plugins with their AWS/Azure SDKs, headers. The smoke
needs the Python bindings, libnixl and the UCX plugin. This keeps every file that is not a
shared library, drops headers and the expert-parallel package, and keeps exactly the shared
libraries reachable through ``DT_NEEDED`` from the bindings, libnixl, the UCX plugin and UCX's
own modules (which UCX opens with dlopen, so they are roots too: without ``libucm_cuda`` UCX
takes VRAM for host memory and NIXL refuses to register it). The result
installs with ``pip install --no-deps`` like the original; its RECORD lists only what it holds.

    python tests/gpu/trim_wheel.py IN.whl OUT_DIR
"""

from __future__ import annotations

import base64
import hashlib
import logging
import struct
import sys
import zipfile
from pathlib import PurePosixPath

log = logging.getLogger(__name__)

DROP_PREFIXES = ("nixl_ep_", )
DROP_PARTS = (".data/headers/", ".data/data/pkgconfig/", "ucx_perftest", "libucx_perftest")
ROOT_PLUGINS = ("libplugin_UCX.so", "libplugin_POSIX.so")


def needed(elf: bytes) -> list[str]:
    """The ``DT_NEEDED`` names of a 64-bit little-endian ELF shared object."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)
                for i in range(shnum)]
    out: list[str] = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab_off = sections[link][4]
        for i in range(size // (entsize or 16)):
            tag, val = struct.unpack_from("<qQ", elf, off + i * 16)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = elf.index(b"\0", strtab_off + val)
                out.append(elf[strtab_off + val:end].decode())
    return out


def is_root(name: str) -> bool:
    base = PurePosixPath(name).name
    return (name.endswith(".cpython-312-x86_64-linux-gnu.so")
            or base.startswith("libnixl") or base in ROOT_PLUGINS
            or "/ucx/" in name)  # UCX's modules: transports and memory hooks (libucm_cuda)


def trim(src: str, out_dir: str) -> str:
    with zipfile.ZipFile(src) as z:
        names = [n for n in z.namelist()
                 if not any(n.startswith(p) for p in DROP_PREFIXES)
                 and not any(p in n for p in DROP_PARTS)]
        libs = {n: z.read(n) for n in names if ".so" in PurePosixPath(n).name}
        by_base: dict[str, list[str]] = {}
        for n in libs:
            by_base.setdefault(PurePosixPath(n).name, []).append(n)
        keep: set[str] = set()
        todo = [n for n in libs if is_root(n)]
        while todo:
            n = todo.pop()
            if n in keep:
                continue
            keep.add(n)
            for dep in needed(libs[n]):
                todo.extend(by_base.get(dep, []))
        kept = [n for n in names if n in keep or n not in libs]
        dest = f"{out_dir}/{PurePosixPath(src).name}"
        record_name = next(n for n in kept if n.endswith(".dist-info/RECORD"))
        rows: list[str] = []
        with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as w:
            for n in kept:
                if n == record_name or n.endswith("/"):
                    continue
                data = z.read(n)
                w.writestr(z.getinfo(n), data, zipfile.ZIP_DEFLATED)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                rows.append(f"{n},sha256={digest.decode()},{len(data)}")
            rows.append(f"{record_name},,")
            w.writestr(z.getinfo(record_name), "\n".join(rows) + "\n", zipfile.ZIP_DEFLATED)
    log.info("kept %d of %d files (%d of %d shared libraries)", len(kept), len(z.namelist()),
             len(keep), len(libs))
    return dest


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.stdout.write(trim(sys.argv[1], sys.argv[2]) + "\n")
