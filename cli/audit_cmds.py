"""``zattera audit [--since 1h] [--user U] [--limit N] [--json]``: who wrote what to the cluster (docs/audit.md).

Entries live in the ``ZATTERA_AUDIT`` stream on ``zattera.audit.<source>``; they are read through a watch
control opens (``zattera.watch.open``: the operator credential creates no consumer), newest first.
"""

from __future__ import annotations

import time

import typer

from cli import render
from cli.client import control, fail, run
from cli.options import JSON, set_output
from shared.audit import DEFAULT_LIMIT, AuditEntry, parse_since, read_entries, select

SCAN = 10_000
"""Without ``--since``, the newest this many entries are looked through (for ``--user``)."""


def _who(entry: AuditEntry) -> str:
    claimed = f" (claims {entry.claimed_user})" if entry.claimed_user and entry.claimed_user != entry.user else ""
    return f"{entry.user}{claimed}"


def _keys(entry: AuditEntry) -> str:
    return ", ".join(f"{k.op} {k.key}" for k in entry.keys)


def audit(
    since: str = typer.Option("", "--since", help="only entries newer than this, e.g. 30m, 1h or 7d"),
    user: str = typer.Option("", "--user", help="only this user's (a name, or a credential's public key)"),
    limit: int = typer.Option(DEFAULT_LIMIT, "--limit", "-n", help="at most this many (0: all)"),
    json: bool = JSON,
) -> None:
    """The audit log: every write made through the CLI and the console, newest first."""
    set_output(json)
    if limit < 0:
        raise fail(f"--limit {limit}: must be 0 or more")
    try:
        start_ns = int((time.time() - parse_since(since)) * 1e9) if since else 0
    except ValueError as exc:
        raise fail(f"--since {since!r}: {exc}") from None

    async def go() -> list[AuditEntry]:
        async with control(view=False) as c:
            return await read_entries(c.conn, since_ns=start_ns, scan=SCAN)

    entries = select(run(go), user=user.strip(), limit=limit)
    if render.json_mode():
        render.emit_json([e.to_dict() for e in entries])
        return
    rows = [
        [
            e.time,
            _who(e),
            "yes" if e.verified else "no",
            e.source,
            e.action + (" (claimed)" if e.action and e.action_claimed else ""),
            _keys(e),
            e.outcome,
            e.address or "-",
            e.request_id,
        ]
        for e in entries
    ]
    render.table(
        "audit log (newest first)",
        ["time", "who", "verified", "source", "action", "keys", "outcome", "from", render.Col("request", wide=True)],
        rows,
    )
