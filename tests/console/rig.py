"""A console on a real NATS server for tests: seeded state (a project/app/env running v2 of two releases, a
node, the cluster secrets key), users, and the aiohttp server on a free port in the test's event loop."""

from __future__ import annotations

import secrets
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from services.console.auth import LoginLimiter, Sessions
from services.console.handling import Console
from services.console.server import start_site
from shared.actions.context import ActionContext
from shared.clock import FakeClock
from shared.connection import Connection
from shared.console_users import ADMIN, VIEWER, new_user, save_user, users_bucket
from shared.secrets import CLUSTER_KEY, key_id
from shared.snapshots.dispatch import SnapshotDispatcher
from shared.state.feed import StateView
from shared.txn import Writer
from tests import factories

ENV_ID = "01ENVWEB"
PASSWORD = "correct horse battery"
ADMIN_USER = "ada"
VIEWER_USER = "vic"
LOGIN_FAILURES = 3


def release(version: int) -> pb.Release:
    r = factories.release(f"01REL{version}", ENV_ID, version=version)
    r.project_id, r.app_id = "01PROJ", "01APP"
    r.image_ref = f"demo/web@sha256:{str(version) * 64}"
    r.meta.created_at.FromSeconds(1_780_000_000 + version)
    return r


async def seed(writer: Writer) -> None:
    project = pb.Project(name="shop")
    project.meta.id = "01PROJ"
    app = pb.App(project_id="01PROJ", name="web")
    app.meta.id = "01APP"
    env = factories.env(ENV_ID, project_id="01PROJ", app_id="01APP", min_replicas=2, active_release_id="01REL2")
    env.name = "production"
    env.service.replicas.max = 4
    env.service.vars["GREETING"] = "hello"
    node = factories.node("n1")
    node.name = "node-one"
    txn = writer.txn()
    for message in (project, app, env, release(1), release(2), cluster_key(), node):
        txn.create(message)
    await writer.commit(txn)


def cluster_key() -> pb.SecretsKey:
    """The cluster secrets key's record as the secrets service publishes it (its private half is not needed)."""
    key = PrivateKey.generate().public_key
    record = pb.SecretsKey(key_id=key_id(bytes(key)), public_key=bytes(key))
    record.meta.id = CLUSTER_KEY
    return record


async def add_users(conn: Connection) -> None:
    await users_bucket(conn.js, create=True)  # as the console does when it starts
    for name, role in ((ADMIN_USER, ADMIN), (VIEWER_USER, VIEWER)):
        await save_user(conn.js, new_user(name, role, PASSWORD, rounds=4))


@dataclass
class Running:
    console: Console
    url: str
    clock: FakeClock


@asynccontextmanager
async def running_console(
    conn: Connection,
    view: StateView,
    writer: Writer,
    *,
    secure_cookies: bool = False,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[Running]:
    clock = FakeClock(1_780_000_000.0)
    console = Console(
        conn=conn,
        view=view,
        actions=ActionContext(
            conn, writer, actor="", snapshots=SnapshotDispatcher(conn, view, clock, first_reply_timeout=2.0)
        ),
        sessions=Sessions(clock, 3600.0),
        limiter=LoginLimiter(clock, LOGIN_FAILURES, 300.0),
        routes=lambda: None,
        secure_cookies=secure_cookies,
    )
    runner: web.AppRunner
    runner, port = await start_site(console, "127.0.0.1", 0, ssl_context, shutdown_timeout=0.1)
    try:
        yield Running(console, f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}", clock)
    finally:
        await runner.cleanup()
        await console.actions.background.close()


def random_secret() -> str:
    return "s3cr3t-" + secrets.token_hex(12)
