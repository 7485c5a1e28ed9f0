"""Services stand alone: no ``services.X`` module imports ``services.Y`` (shared code lives in shared/), and
shared/ imports no service. The all-in-one process, which runs every service, is composed in cli/control_plane.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(source: str, package: tuple[str, ...]) -> list[str]:
    """Absolute module names imported by ``source``, a module of ``package`` (relative imports resolved)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
    return found


def service_imports() -> list[str]:
    """``file: module`` for every import of another service (or of any service from shared/)."""
    crossing = []
    for path in sorted((ROOT / "services").rglob("*.py")) + sorted((ROOT / "shared").rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        own = parts[1] if parts[0] == "services" and len(parts) > 2 else None
        package = path.relative_to(ROOT).parts[:-1]
        for module in imported_modules(path.read_text(), package):
            target = module.split(".")
            if target[0] == "services" and len(target) > 1 and target[1] != own:
                crossing.append(f"{path.relative_to(ROOT)}: {module}")
    return crossing


def test_no_service_imports_another_service() -> None:
    assert service_imports() == []


def test_the_check_sees_every_form_of_import() -> None:
    source = "import services.a.x\nfrom services.b import y\nfrom ..c import z\nfrom . import w\nfrom .v import u\n"
    assert imported_modules(source, ("services", "d")) == [
        "services.a.x",
        "services.b",
        "services.c",
        "services.d.w",
        "services.d.v",
    ]
