"""The webhook rig shared by tests/githooks and benchmarks/webhook_bench.py: a seeded cluster state (project
shop, app web, env production with two sealed secrets and the cluster key), a repository served by ``git
http-backend`` that requires the hook's token, a commit-status stand-in, the console, the secrets service's
gate and the ``githooks`` loop consuming deliveries (its passes run by the caller, on a fake clock)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from services.secrets.githook_gate import HookGate
from services.secrets.githooks import GitHooks, GitHooksSettings
from shared import githooks as G
from shared import keys as K
from shared.actions.context import ActionContext
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.secrets import CLUSTER_KEY, Keyring, key_id, public_bytes, seal
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX
from shared.txn import Writer
from tests.console.rig import running_console
from tests.githooks import payloads as P
from tests.githooks.gitserver import GitHttpServer, Repo, StatusApi

TOKEN = "glpat-T0K3N-do-not-leak-41c9"
DB_URL = "postgres://db-secret-value-5e1"
API_KEY = "api-key-secret-value-77b"
ENV_ID = "01ENVBASE"
DOMAIN = "apps.test"


@dataclass
class Rig:
    ctx: ActionContext
    view: StateView
    repo: Repo
    server: GitHttpServer
    status: StatusApi
    console_url: str
    loop: GitHooks
    clock: FakeClock
    events: list[pb.Event]
    http: aiohttp.ClientSession

    @property
    def clone_url(self) -> str:
        return f"{self.server.url}/app.git"

    async def post(self, provider: str, hook_id: str, delivery: P.Delivery) -> tuple[int, float]:
        started = time.perf_counter()
        async with self.http.post(
            f"{self.console_url}/hooks/{provider}/{hook_id}", data=delivery.body, headers=delivery.headers
        ) as response:
            await response.read()
            return response.status, time.perf_counter() - started

    def builds(self, env_id: str) -> list[pb.Build]:
        return list(self.view.builds(env_id))

    async def end_deployments(self, env_id: str, phase: int = pb.DEPLOYMENT_PHASE_SUCCEEDED) -> None:
        """What the orchestrator does once a deployment is live (none runs here)."""
        writer = Writer(self.ctx.conn, self.view)
        txn = writer.txn()
        for d in self.view.deployments(env_id):
            if d.phase not in (pb.DEPLOYMENT_PHASE_SUCCEEDED, pb.DEPLOYMENT_PHASE_FAILED):
                ended = pb.Deployment()
                ended.CopyFrom(d)
                ended.phase = phase  # type: ignore[assignment]
                txn.put(ended)
        await writer.commit(txn)


async def seed(conn: Connection, view: StateView) -> tuple[ActionContext, Keyring]:
    key = PrivateKey.generate()
    record = pb.SecretsKey(key_id=key_id(public_bytes(key)), public_key=public_bytes(key))
    record.meta.id = CLUSTER_KEY
    project = pb.Project(name="shop")
    project.meta.id = "01PROJ"
    app = pb.App(project_id="01PROJ", name="web")
    app.meta.id = "01APP"
    env = pb.Environment(
        app_id="01APP", project_id="01PROJ", name="production", type=pb.ENVIRONMENT_TYPE_STANDARD, effective_replicas=2
    )
    env.meta.id = ENV_ID
    env.service.replicas.min, env.service.replicas.max = 2, 4
    env.service.ports.add(name="http", container_port=8080, protocol=pb.PROTOCOL_HTTP)
    env.service.vars["GREETING"] = "hello"
    writer = Writer(conn, view)
    txn = writer.txn().create(record).create(project).create(app)
    for name, value in (("DB_URL", DB_URL), ("API_KEY", API_KEY)):
        secret = pb.SealedSecret(
            environment_id=ENV_ID,
            project_id="01PROJ",
            name=name,
            version=1,
            ciphertext=seal(record.public_key, value.encode()),
            key_id=record.key_id,
        )
        secret.meta.id = f"01SEC{name.replace('_', '')}"
        env.service.secrets[name].secret_id = secret.meta.id
        env.service.secrets[name].version = 1
        txn.create(secret)
    await writer.commit(txn.create(env))
    return ActionContext(conn, writer, "tester"), Keyring([key])


@asynccontextmanager
async def rig_for(provider: str, conn: Connection, view: StateView, tmp_path: Path) -> AsyncIterator[Rig]:
    ctx, keyring = await seed(conn, view)
    repo = Repo.create(tmp_path)
    repo.commit({"app.py": "print('v1')\n"}, "First")
    server = GitHttpServer(tmp_path / "served", required_auth=G.fetch_auth_header(provider, TOKEN))
    await server.start()
    status = StatusApi()
    await status.start()
    events: list[pb.Event] = []

    async def got(msg: object) -> None:
        events.append(pb.Event.FromString(msg.data))  # type: ignore[attr-defined]

    sub = await conn.nc.subscribe(f"{EVENTS_SUBJECT_PREFIX}>", cb=got)
    gate = HookGate(conn, lambda hook_id: _hook(view, hook_id), lambda: keyring)
    await gate.start(1)
    clock = FakeClock(1_790_000_000.0)
    loop = GitHooks(
        LoopDeps(conn, view, clock, coalesce=0.0),
        lambda: keyring,
        settings=GitHooksSettings(domain=DOMAIN, fetch_wait=0.2, supersede_wait=5.0),
    )
    loop.writer = Writer(conn, view)  # what a term's fenced writer does, without the lease
    await loop.begin_term()
    try:
        async with running_console(conn, view, ctx.writer) as console, aiohttp.ClientSession() as http:
            yield Rig(ctx, view, repo, server, status, console.url, loop, clock, events, http)
    finally:
        await loop.end_term()
        await gate.stop()
        await sub.unsubscribe()
        await server.stop()
        await status.stop()


def _hook(view: StateView, hook_id: str) -> pb.GitHook | None:
    found = view.get(K.GIT_HOOK, hook_id)
    return found if isinstance(found, pb.GitHook) else None
