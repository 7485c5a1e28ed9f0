"""Member credentials minted for admins (``zattera.teams.issue``, docs/teams.md): the member role's signing key
stays on the control side; an admin (the ``OPERATORS`` account) or control asks, a member never may."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from shared.connection import Connection
from shared.security.authority import RoleIssuer
from shared.security.callers import answerable, caller
from shared.security.creds import creds_text
from shared.security.nkeyjwt import KeyKind, KeyPair


def member_issue_handler(
    conn: Connection, issuer: RoleIssuer | None, admins_account: str
) -> Callable[[Msg], Awaitable[None]]:
    """``zattera.teams.issue``: a member credential named ``name``, for an admin (operator) or control."""

    async def on_issue(msg: Msg) -> None:
        if not answerable(msg):
            return
        who = caller(msg)
        reply: dict[str, str]
        if issuer is None:
            reply = {"error": "no member signing key on this control service"}
        elif who is not None and who.account != admins_account:
            reply = {"error": "not authorised: only admins issue member credentials"}
        else:
            try:
                name = str(json.loads(msg.data or b"{}").get("name", ""))
            except (ValueError, AttributeError):
                name = ""
            if not name or " " in name:
                reply = {"error": "name: required"}
            else:
                user = KeyPair.generate(KeyKind.USER)
                creds = creds_text(issuer.user_jwt(name, user.public_key), user.seed)
                reply = {"creds": creds, "user_key": user.public_key}
        await conn.nc.publish(msg.reply, json.dumps(reply).encode())

    return on_issue
