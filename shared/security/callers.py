"""Who asks: control-side handlers acting for a caller read it from the server, never from the request.

A request that crossed a service import (every request of an agent, proxy or operator: they live in role
accounts, SECURITY.md) carries ``Nats-Request-Info``, set by nats-server from the connection that sent it
(account, user public key, the signing key that issued it, ``name_tag`` = the user's name: a node id or a
proxy id); a header of the same name sent by the client is replaced. A handler answers only reply subjects
a requester can own: ``_INBOX.`` (a client in the same account) or ``_R_.`` (the server's mapping back into
the requester's account) — never a subject that could be a stream's or another client's request subject.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nats.aio.msg import Msg

REQUEST_INFO_HEADER = "Nats-Request-Info"
ANSWERABLE_PREFIXES = ("_INBOX.", "_R_.")


def answerable(msg: Msg) -> bool:
    """True when ``msg``'s reply subject is one a requester owns (see the module docstring)."""
    return msg.reply.startswith(ANSWERABLE_PREFIXES)


@dataclass(frozen=True)
class Caller:
    account: str
    user: str
    issuer_key: str
    name: str
    host: str = ""
    """The client's address as the server saw it (audit entries)."""


def caller(msg: Msg) -> Caller | None:
    """The server-set identity of the requester, or None for a request from inside ``ZATTERA`` (control)."""
    raw = (msg.headers or {}).get(REQUEST_INFO_HEADER)
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    return Caller(
        account=str(info.get("acc") or ""),
        user=str(info.get("user") or ""),
        issuer_key=str(info.get("issuer_key") or ""),
        name=str(info.get("name_tag") or ""),
        host=str(info.get("host") or ""),
    )
