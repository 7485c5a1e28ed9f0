"""The ``zattera-teams`` bucket, the admins' side (docs/teams.md): load, save and remove user and token
records, list them all, and ask control for a member credential.

What a record holds and what each role may do is :mod:`shared.teams`; the bucket is created by the join
service of a secured cluster and written only with the operator credential.
"""

from __future__ import annotations

import json
from typing import Any

from shared.errors import ZatteraError
from shared.teams import TEAMS_BUCKET, TEAMS_ISSUE_SUBJECT, TEAMS_STREAM, TeamError, Token, User, token_key, user_key


class NoTeamsBucket(ZatteraError):
    """The join service of a secured cluster creates the bucket; an operator credential may not."""


async def _bucket(js: Any) -> Any:
    from nats.js.errors import BucketNotFoundError

    try:
        return await js.key_value(TEAMS_BUCKET)
    except BucketNotFoundError:
        raise NoTeamsBucket(
            f"no {TEAMS_BUCKET} bucket yet: teams need a secured cluster (`zattera up --secure`, docs/teams.md)"
        ) from None


async def _load(js: Any, key: str) -> bytes | None:
    from nats.js.errors import KeyNotFoundError

    kv = await _bucket(js)
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    return bytes(entry.value) if entry.value else None


async def load_user(js: Any, name: str) -> User | None:
    raw = await _load(js, user_key(name))
    return User.from_json(raw) if raw else None


async def save_user(js: Any, user: User) -> None:
    await (await _bucket(js)).put(user_key(user.name), user.to_json())


async def load_token(js: Any, name: str) -> Token | None:
    raw = await _load(js, token_key(name))
    return Token.from_json(raw) if raw else None


async def save_token(js: Any, token: Token) -> None:
    await (await _bucket(js)).put(token_key(token.name), token.to_json())


async def delete_record(js: Any, key: str) -> None:
    await (await _bucket(js)).purge(key)


async def all_records(nc: Any, js: Any) -> tuple[list[User], list[Token]]:
    """Every user and token, with one batch direct get (an operator creates no consumer)."""
    from shared.directget import last_per_subject
    from shared.jetstream import is_delete_marker

    await _bucket(js)
    msgs = await last_per_subject(nc, TEAMS_STREAM, f"$KV.{TEAMS_BUCKET}.>", 5.0)
    users: list[User] = []
    tokens: list[Token] = []
    for msg in msgs:
        if is_delete_marker(msg.headers) or not msg.data:
            continue
        key = (msg.headers or {}).get("Nats-Subject", "").removeprefix(f"$KV.{TEAMS_BUCKET}.")
        if key.startswith("user."):
            users.append(User.from_json(msg.data))
        elif key.startswith("token."):
            tokens.append(Token.from_json(msg.data))
    return sorted(users, key=lambda u: u.name), sorted(tokens, key=lambda t: t.name)


async def issue_member_creds(nc: Any, name: str) -> tuple[str, str]:
    """A member credential named ``name`` from control (:data:`TEAMS_ISSUE_SUBJECT`): (creds text, user key)."""
    import nats.errors

    try:
        reply = await nc.request(TEAMS_ISSUE_SUBJECT, json.dumps({"name": name}).encode(), timeout=5.0)
    except nats.errors.NoRespondersError:
        raise TeamError("no control service issues member credentials: is the cluster secured?") from None
    answer = json.loads(reply.data or b"{}")
    if answer.get("error"):
        raise TeamError(f"member credential refused: {answer['error']}")
    return str(answer["creds"]), str(answer["user_key"])
