"""The router reads in call order: no function longer than a screen, and no router class that
inherits another router class to share its code (the request path was once one class split
over three files by inheritance, where a reader lost the trail at every ``self._x``).

Allowed bases from within the router: abstract interfaces (``Policy``, an ``ABC``), and the
OpenAI request schemas, whose shared fields are the OpenAI spec's own (pydantic models).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parent.parent / "router"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(ROUTER.glob("*.py"))}


def test_no_router_function_is_longer_than_a_screen() -> None:
    long = [f"router/{name}.py:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for name, tree in _modules().items() for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def _classes() -> dict[str, tuple[str, ast.ClassDef]]:
    """Every class defined in router/: name -> (module, definition)."""
    return {n.name: (mod, n) for mod, tree in _modules().items() for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef)}


def _is_interface(cls: ast.ClassDef) -> bool:
    """An ABC, or a pydantic schema: a class whose own base is ``ABC`` or ``BaseModel``."""
    return any(ast.unparse(b) in ("ABC", "BaseModel") for b in cls.bases)


def test_no_router_class_inherits_a_router_class_for_its_code() -> None:
    classes = _classes()
    bad = []
    for name, (mod, cls) in classes.items():
        for base in cls.bases:
            b = ast.unparse(base)
            if b in classes and not _is_interface(classes[b][1]):
                bad.append(f"router/{mod}.py: {name}({b})")
    assert not bad, bad


def test_the_checks_see_what_they_forbid() -> None:
    """The checks above tell an implementation base from an interface (no vacuous pass)."""
    tree = ast.parse("class A:\n    pass\n\nclass B(ABC):\n    pass\n")
    a, b = (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    assert not _is_interface(a) and _is_interface(b)
    classes = _classes()
    assert "Lifecycle" in classes and _is_interface(classes["Policy"][1])
