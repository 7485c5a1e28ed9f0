"""Which migrations exist, in order: the modules ``m<NNNN>_<name>.py`` of this package.

The number in a module's name is the schema version the cluster is at once it has run; numbers start at 1
and follow each other without a gap. :data:`SCHEMA` (the schema this code brings a cluster to) is read from
the module names alone, without importing them, so ``shared/provisioning.py`` can record it at a cluster's init;
:func:`load` imports them (:mod:`shared.migrations.runner` and the tests).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import ZatteraError

if TYPE_CHECKING:
    from shared.migrations.base import Step

MODULE_NAME = re.compile(r"^m(\d{4})_([a-z0-9_]+)$")
PACKAGE = "shared.migrations"


class RegistryError(ZatteraError):
    """The migration modules are misnumbered (two with one number, a gap) or one lacks its ``MIGRATION``."""


@dataclass(frozen=True)
class Listed:
    """A migration module, by name: its number and its name (``build_events_per_sender``)."""

    number: int
    name: str
    module: str

    @property
    def label(self) -> str:
        """``0001 build-events-per-sender``: how logs, events and docs name it."""
        return f"{self.number:04d} {self.name.replace('_', '-')}"


HERE = Path(__file__).parent


def _found(directory: Path = HERE) -> list[Listed]:
    found = []
    for info in pkgutil.iter_modules([str(directory)]):
        match = MODULE_NAME.match(info.name)
        if match:
            found.append(Listed(int(match.group(1)), match.group(2), f"{PACKAGE}.{info.name}"))
    return sorted(found, key=lambda m: (m.number, m.name))


def listed(directory: Path = HERE) -> list[Listed]:
    """Every migration module in number order; :class:`RegistryError` when numbers repeat or leave a gap."""
    found = _found(directory)
    for expected, migration in enumerate(found, start=1):
        if migration.number != expected:
            others = [m.module for m in found if m.number == migration.number]
            why = (
                f"two migrations numbered {migration.number}: {', '.join(others)}"
                if len(others) > 1
                else (f"migration {expected} is missing (next is {migration.module})")
            )
            raise RegistryError(f"{why}; renumber the newest (docs/upgrades.md, 'Adding a migration')")
    return found


SCHEMA = max((m.number for m in _found()), default=0)
"""The schema version of this code: the cluster's once every migration has run (a new cluster is recorded
at it). Misnumbered modules are reported by :func:`listed` (the upgrade and a unit test), not here: an
import must not fail."""


def load() -> list[Step]:
    """Every migration, in order, with its module's ``MIGRATION``."""
    from shared.migrations.base import Migration, Step

    steps = []
    for entry in listed():
        migration = getattr(importlib.import_module(entry.module), "MIGRATION", None)
        if not isinstance(migration, Migration):
            raise RegistryError(f"{entry.module} defines no MIGRATION = Migration(...)")
        steps.append(Step(entry, migration))
    return steps
