"""The installed Zattera's version: what ``zattera --version`` prints and an agent reports on its node."""

from __future__ import annotations

from importlib import metadata


def zattera_version() -> str:
    """The package's version (pyproject.toml), or ``dev`` when run from a tree that is not installed."""
    try:
        return metadata.version("zattera")
    except metadata.PackageNotFoundError:
        return "dev"
