"""The benchmarks' one runner: ``python -m bench`` lists the suites and their benchmarks,
``python -m bench SUITE NAME [ARGS...]`` runs ``bench.SUITE.NAME`` with ``ARGS``."""

from __future__ import annotations

import ast
import pkgutil
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def catalogue() -> dict[str, dict[str, str]]:
    """suite -> {benchmark: its docstring's first line}, for modules that run as a program."""
    out: dict[str, dict[str, str]] = {}
    for suite in sorted(p.name for p in HERE.iterdir() if (p / "__init__.py").exists()):
        for info in pkgutil.iter_modules([str(HERE / suite)]):
            src = (HERE / suite / f"{info.name}.py").read_text()
            if '__name__ == "__main__"' not in src:
                continue  # a helper of the suite, not a benchmark
            doc = ast.get_docstring(ast.parse(src)) or ""
            out.setdefault(suite, {})[info.name] = doc.split("\n")[0]
    return out


def main(argv: list[str]) -> int:
    cat = catalogue()
    if len(argv) < 2 or argv[0] not in cat or argv[1] not in cat[argv[0]]:
        lines = ["usage: python -m bench SUITE NAME [ARGS...]", ""]
        for suite, benches in cat.items():
            lines.append(f"{suite}/")
            lines += [f"  {name:<18} {doc}" for name, doc in benches.items()]
        sys.stdout.write("\n".join(lines) + "\n")
        return 0 if not argv else 2
    sys.argv = [f"bench.{argv[0]}.{argv[1]}", *argv[2:]]
    runpy.run_module(f"bench.{argv[0]}.{argv[1]}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
