"""Web console users (docs/console.md): bcrypt-hashed passwords in the ``zattera-console`` KV bucket.

One key per user, ``user.<name>``, holding JSON ``{"name", "role", "password_bcrypt", "created_at"}``. Only
the hash is stored; the password never leaves the process that hashed it. ``zattera console add-user`` writes
these records and the console service reads them at each login.
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from shared.errors import ZatteraError
from shared.provisioning import recorded_replicas

USERS_BUCKET = "zattera-console"
ADMIN = "admin"
VIEWER = "viewer"
ROLES = (ADMIN, VIEWER)
MIN_PASSWORD = 10
MAX_PASSWORD = 72  # bcrypt uses the first 72 bytes only: longer would silently be cut
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


class UserError(ZatteraError, ValueError):
    """A refused user name, role or password; the message names the field."""


@dataclass(frozen=True, slots=True)
class ConsoleUser:
    name: str
    role: str
    password_bcrypt: str
    created_at: float

    def as_json(self) -> dict[str, object]:
        """What may be shown: never the hash."""
        return {"name": self.name, "role": self.role, "created_at": self.created_at}


def check_user(name: str, role: str, password: str) -> None:
    if not _NAME.match(name):
        raise UserError(f"name {name!r}: use 1-64 of a-z, 0-9, '_', '.', '-', starting with a letter or digit")
    if role not in ROLES:
        raise UserError(f"--role {role!r}: must be one of {', '.join(ROLES)}")
    size = len(password.encode())
    if size < MIN_PASSWORD or size > MAX_PASSWORD:
        raise UserError(f"password: must be {MIN_PASSWORD} to {MAX_PASSWORD} bytes long")


def new_user(name: str, role: str, password: str, *, rounds: int = 12, now: float | None = None) -> ConsoleUser:
    import bcrypt  # here: the node's agent imports this module (permissions) and never hashes a password

    check_user(name, role, password)
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()
    return ConsoleUser(name, role, hashed, time.time() if now is None else now)


def password_matches(user: ConsoleUser, password: str) -> bool:
    import bcrypt

    return bcrypt.checkpw(password.encode()[:MAX_PASSWORD], user.password_bcrypt.encode())


@functools.cache
def _dummy_hash() -> bytes:
    import bcrypt

    return bcrypt.hashpw(b"no such user", bcrypt.gensalt(4))


def burn_check(password: str) -> None:
    """A check against nothing, so an unknown name costs about as long as a wrong password."""
    import bcrypt

    bcrypt.checkpw(password.encode()[:MAX_PASSWORD], _dummy_hash())


def user_key(name: str) -> str:
    return f"user.{name}"


async def users_bucket(js: JetStreamContext, *, create: bool) -> KeyValue | None:
    """The users bucket; created (with the cluster's recorded replica count) when ``create`` and missing."""
    try:
        return await js.key_value(USERS_BUCKET)
    except BucketNotFoundError:
        if not create:
            return None
    return await js.create_key_value(bucket=USERS_BUCKET, history=1, replicas=await recorded_replicas(js))


class NoUsersBucket(ZatteraError):
    """The console has not run yet: it creates the bucket (an operator's credential may not create streams)."""


async def save_user(js: JetStreamContext, user: ConsoleUser) -> None:
    kv = await users_bucket(js, create=False)
    if kv is None:
        raise NoUsersBucket(
            f"no {USERS_BUCKET} bucket yet: start the console once (`zattera up` does; docs/console.md)"
        )
    doc = {"name": user.name, "role": user.role, "password_bcrypt": user.password_bcrypt, "created_at": user.created_at}
    await kv.put(user_key(user.name), json.dumps(doc).encode())


async def load_user(js: JetStreamContext, name: str) -> ConsoleUser | None:
    if not _NAME.match(name):
        return None
    kv = await users_bucket(js, create=False)
    if kv is None:
        return None
    try:
        entry = await kv.get(user_key(name))
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    doc = json.loads(entry.value)
    return ConsoleUser(doc["name"], doc["role"], doc["password_bcrypt"], float(doc["created_at"]))


async def list_users(js: JetStreamContext) -> list[ConsoleUser]:
    kv = await users_bucket(js, create=False)
    if kv is None:
        return []
    try:
        keys = await kv.keys()
    except NoKeysError:
        return []
    found = [await load_user(js, key.removeprefix("user.")) for key in sorted(keys)]
    return [u for u in found if u is not None]


async def remove_user(js: JetStreamContext, name: str) -> bool:
    kv = await users_bucket(js, create=False)
    if kv is None or await load_user(js, name) is None:
        return False
    await kv.purge(user_key(name))
    return True
