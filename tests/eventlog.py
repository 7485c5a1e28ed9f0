"""Reading the platform event stream in tests (what ``zattera events`` reads)."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared.connection import Connection
from shared.subjects import EVENTS_STREAM
from tests.waiting import eventually


async def stored_events(conn: Connection) -> list[pb.Event]:
    """Every event stored in ``ZATTERA_EVENTS``, oldest first."""
    info = await conn.js.stream_info(EVENTS_STREAM)
    events = []
    for seq in range(info.state.first_seq or 1, info.state.last_seq + 1):
        msg = await conn.js.get_msg(EVENTS_STREAM, seq)
        events.append(pb.Event.FromString(msg.data or b""))
    return events


async def stored_kinds(conn: Connection) -> list[str]:
    return [e.kind for e in await stored_events(conn)]


async def wait_for_kinds(conn: Connection, *kinds: str, timeout: float = 10.0) -> list[pb.Event]:
    """Wait until events of every kind in ``kinds`` are stored; returns every stored event."""
    found: list[pb.Event] = []

    async def stored() -> bool:
        found[:] = await stored_events(conn)
        return set(kinds) <= {e.kind for e in found}

    await eventually(stored, timeout, f"events {kinds}")
    return found


def one(events: list[pb.Event], kind: str) -> pb.Event:
    [event] = [e for e in events if e.kind == kind]
    return event
