"""Zattera's version: what ``zattera --version`` prints, what every process logs at start and reports (an
agent's ``Node.binary_version``, a proxy's heartbeat, a leader's lease), and what the version-skew rules
compare (``shared/skew.py``, docs/upgrades.md).

:data:`VERSION` is the code's own, so a tree pulled but not reinstalled still reports what runs; it equals
``pyproject.toml``'s version and the newest ``CHANGELOG.md`` entry (a test checks all three).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from shared.errors import ZatteraError

VERSION = "0.2.0"
"""This release. Bumped with pyproject.toml and a CHANGELOG.md entry (docs/upgrades.md, "Releasing")."""

LEGACY_VERSION = "0.1.0"
"""What a cluster or node that recorded no version is taken to run: every build before versions were
recorded (0.1.0 and the commits before it) reported 0.1.0."""


class BadVersion(ZatteraError, ValueError):
    """A string that is no version (a node record written by hand, say)."""


def zattera_version() -> str:
    return VERSION


def release_line(version: str) -> tuple[int, int]:
    """(major, minor) of ``version``: what the skew rules count in (patch releases never differ in what may
    run together). Raises :class:`BadVersion` for a string that is no version."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise BadVersion(f"{version!r} is not a version") from None
    return parsed.major, parsed.minor


def newer(a: str, b: str) -> bool:
    """``a`` is a later version than ``b``."""
    return Version(a) > Version(b)
