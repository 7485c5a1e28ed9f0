"""A constant's docstring stands right under it: a docstring that follows another docstring (a constant put in
between them, or a blank line) documents nothing, and the constant above it reads as undocumented."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def stray_docstrings(source: str) -> list[int]:
    """The lines of docstrings, at module or class level, that follow another docstring or a blank line."""
    tree = ast.parse(source)
    stray = []
    for owner in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
        for before, node in zip(owner.body, owner.body[1:], strict=False):
            if not _is_docstring(node):
                continue
            end = before.end_lineno or before.lineno
            if _is_docstring(before) or node.lineno > end + 1:
                stray.append(node.lineno)
    return stray


def test_every_constant_docstring_stands_under_its_constant() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for top in ("shared", "services", "cli")
        for path in sorted((ROOT / top).rglob("*.py"))
        for line in stray_docstrings(path.read_text())
    ]
    assert found == []


def test_the_check_finds_a_docstring_parted_from_its_constant() -> None:
    source = 'A = 1\nB = 2\n"""of B"""\n"""of A, parted"""\nC = 3\n\n"""of C, after a blank line"""\n'
    assert stray_docstrings(source) == [4, 7]
    assert stray_docstrings('"""module"""\n\nA = 1\n"""of A"""\n') == []
