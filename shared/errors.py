"""The root of Zattera's own errors.

Every error a Zattera module raises on purpose (bad input, a refused or conflicting write, a missing
object, a peer's error reply) derives from :class:`ZatteraError`, so a caller that must not fail on them
— the CLI turning one into a one-line message, a loop logging it — catches one type, and anything else
is a bug that should surface. Errors that are also a ``ValueError`` (bad input) keep that base too.
"""

from __future__ import annotations


class ZatteraError(Exception):
    """An expected failure with a message fit for an operator (one line, naming what was wrong)."""
