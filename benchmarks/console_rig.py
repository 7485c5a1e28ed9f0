"""What the console benchmarks share (``console_bench``, ``metrics_bench``): a state to seed on a real
nats-server, a project of N environments each with its app and active release, the console started in process
with a benchmark admin, and an HTTP session logged in to it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared.connection import Connection, connect
from shared.console_users import ADMIN, new_user, save_user, users_bucket
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Writer
from tests.console.rig import Running, running_console

USER = "bench"
PASSWORD = "benchmark password"
PROJECT_ID = "01BENCHPROJ"


@dataclass(frozen=True)
class Bench:
    conn: Connection
    view: StateView
    writer: Writer


@asynccontextmanager
async def bench_state(url: str) -> AsyncIterator[Bench]:
    """A connection to the server at ``url`` with the cluster's buckets provisioned, a started view and a writer."""
    conn = await connect(url, name="bench")
    await provision(conn.js)
    view = StateView(conn, name="bench")
    await view.start()
    try:
        yield Bench(conn, view, Writer(conn, view))
    finally:
        await view.stop()
        await conn.close()


Extra = Callable[[int, pb.Environment, pb.Release], Iterable[tuple[Message, str | None]]]
"""An env's own objects (domains, assignments …) to create with it, each with its key (None: its own), from
(index, env, release); it may fill in the env and release too."""


async def seed_envs(
    writer: Writer, count: int, env_id: Callable[[int], str], *, min_replicas: int = 1, extra: Extra | None = None
) -> list[str]:
    """``count`` envs ``app<i>/production`` of one project, each with an active release v1, one transaction
    each; their ids."""
    project = pb.Project(name="bench")
    project.meta.id = PROJECT_ID
    txns = [writer.txn().create(project)]
    env_ids = []
    for i in range(count):
        app = pb.App(project_id=project.meta.id, name=f"app{i:05d}")
        app.meta.id = f"01BENCHAPP{i:05d}"
        env = pb.Environment(project_id=project.meta.id, app_id=app.meta.id, name="production")
        env.meta.id = env_id(i)
        env.service.replicas.min, env.service.replicas.max = min_replicas, 10
        release = pb.Release(environment_id=env.meta.id, app_id=app.meta.id, project_id=project.meta.id, version=1)
        release.meta.id = f"01BENCHREL{i:05d}"
        env.active_release_id = release.meta.id
        more = list(extra(i, env, release)) if extra is not None else []
        txn = writer.txn().create(app).create(env).create(release)
        for msg, key in more:
            if key:
                txn.put(msg, key=key)
            else:
                txn.create(msg)
        txns.append(txn)
        env_ids.append(env.meta.id)
    failures = [r for r in await writer.commit_many(txns) if r is not None]
    assert not failures, failures[:3]
    return env_ids


@asynccontextmanager
async def bench_console(bench: Bench) -> AsyncIterator[Running]:
    """The console in process on a free port, with the benchmark's admin user (as the console's start creates the
    users bucket)."""
    await users_bucket(bench.conn.js, create=True)
    await save_user(bench.conn.js, new_user(USER, ADMIN, PASSWORD, rounds=4))
    async with running_console(bench.conn, bench.view, bench.writer) as console:
        yield console


@asynccontextmanager
async def logged_in(url: str) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP session logged in to the console at ``url`` as the benchmark's admin."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(f"{url}/login") as page:
            token = re.search(r'name="login_token" value="([^"]+)"', await page.text())
        assert token is not None
        form = {"username": USER, "password": PASSWORD, "login_token": token.group(1)}
        async with http.post(f"{url}/login", data=form) as done:
            assert done.status == 200
        yield http
