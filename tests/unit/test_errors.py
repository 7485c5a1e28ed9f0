"""Every exception class Zattera defines derives from one root (shared/errors.py), so the CLI can turn any
of them into one line; input errors stay ValueErrors too, connection errors ConnectionErrors."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from shared.errors import ZatteraError

ROOT = Path(__file__).resolve().parents[2]


def defined_exceptions() -> list[tuple[str, type[BaseException]]]:
    """(module, class) of every exception class defined in shared/, services/ and cli/."""
    found = []
    for path in sorted([*ROOT.glob("shared/**/*.py"), *ROOT.glob("services/**/*.py"), *ROOT.glob("cli/*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found.append((name, value))
    return found


def test_every_error_derives_from_the_root() -> None:
    found = defined_exceptions()
    strays = [f"{module}.{cls.__qualname__}" for module, cls in found if not issubclass(cls, ZatteraError)]
    assert len(found) > 50 and strays == []


def test_input_errors_stay_value_errors() -> None:
    from cli.spec import SpecError
    from shared.actions.refusals import Invalid
    from shared.appconfig import ConfigError
    from shared.connection import ClusterUnavailable
    from shared.keys import BadKey
    from shared.txn import Conflict

    for cls in (ConfigError, Invalid, BadKey, SpecError):
        assert issubclass(cls, ZatteraError) and issubclass(cls, ValueError), cls
    assert issubclass(ClusterUnavailable, ZatteraError) and issubclass(ClusterUnavailable, ConnectionError)
    assert issubclass(Conflict, ZatteraError)
