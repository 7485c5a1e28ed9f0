"""One version, said the same everywhere (pyproject.toml, shared/version.py, CHANGELOG.md's newest entry),
and every migration numbered without gaps and listed in CHANGELOG.md and docs/upgrades.md."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from shared.migrations.registry import SCHEMA, RegistryError, listed, load
from shared.version import VERSION, zattera_version

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_packages_and_the_changelogs_newest() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == VERSION == zattera_version()
    entries = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert entries[0] == VERSION, entries


def test_every_migration_is_in_the_changelog_under_its_release_and_in_the_upgrade_docs() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    entries = dict(re.findall(r"^## (\d+\.\d+\.\d+)[^\n]*\n(.*?)(?=^## |\Z)", changelog, re.M | re.S))
    docs = (ROOT / "docs" / "upgrades.md").read_text()
    steps = load()
    assert [s.number for s in steps] == list(range(1, SCHEMA + 1))
    for step in steps:
        assert step.migration.release in entries, f"{step.label}: no CHANGELOG entry {step.migration.release}"
        assert f"`{step.label}`" in entries[step.migration.release], f"{step.label} not in its CHANGELOG entry"
        assert f"`{step.label}`" in docs, f"{step.label} not listed in docs/upgrades.md"
    assert f"schema {SCHEMA}" in entries[VERSION].lower()


@pytest.mark.parametrize(
    ("files", "error"),
    [
        (["m0001_a.py", "m0002_b.py", "m0002_c.py"], "two migrations numbered 2"),
        (["m0001_a.py", "m0003_c.py"], "migration 2 is missing"),
    ],
)
def test_misnumbered_migrations_are_refused_naming_them(tmp_path: Path, files: list[str], error: str) -> None:
    for name in files:
        (tmp_path / name).write_text("")
    with pytest.raises(RegistryError, match=error):
        listed(tmp_path)


def test_modules_that_are_not_migrations_are_ignored(tmp_path: Path) -> None:
    for name in ("m0001_a.py", "base.py", "runner.py", "m2_short.py"):
        (tmp_path / name).write_text("")
    assert [m.name for m in listed(tmp_path)] == ["a"]
