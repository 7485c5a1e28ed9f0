"""How long identifiers and references are shown (issue 40, design): short in tables, whole on demand.

Registered as Jinja filters by ``handling.Console``: ``short_id`` (the last 8 characters of a ULID-like id,
unique enough to tell rows apart), ``short_ref`` (an image reference without its registry path, a digest cut
to 12 hex digits). The whole value stays in the page inside a ``<details>`` (keyboard-reachable) and a
``title``."""

from __future__ import annotations

SHORT_ID = 8
DIGEST_SHOWN = 12


def short_id(ident: str) -> str:
    """``01JD5Q8ZKX3V7W9YB2C4E6G8HJ`` → ``…C4E6G8HJ``; short ids unchanged."""
    return ident if len(ident) <= SHORT_ID + 2 else "…" + ident[-SHORT_ID:]


def short_ref(ref: str) -> str:
    """``registry.example.com/team/web@sha256:2222…`` → ``web@2222222222222``; ``…/web:1.4`` → ``web:1.4``."""
    if not ref:
        return ref
    name, at, digest = ref.partition("@")
    last = name.rsplit("/", 1)[-1]
    if at:
        return f"{last}@{digest.removeprefix('sha256:')[:DIGEST_SHOWN]}"
    return last


FILTERS = {"short_id": short_id, "short_ref": short_ref}
