"""The names a user gives to what a project holds beside its apps (a log drain, a notification channel): DNS
labels."""

from __future__ import annotations

import re

_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def label_problem(name: str, what: str) -> str | None:
    """Why ``name`` cannot name a ``what`` (None: it can): lowercase letters, digits and '-', at most 63."""
    if not _LABEL.match(name):
        return f"{name!r} is not a {what} name (lowercase letters, digits and '-', at most 63)"
    return None
