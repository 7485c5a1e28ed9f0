"""Teams on a secured cluster (docs/teams.md): per-project roles and API tokens, enforced on the control side.

Real nats-server in operator mode (conftest.py), the join service with the authorising path, members connected
with their own credentials (the MEMBERS account). For each role, the allowed writes and reads succeed and every
other is refused with a clear error — nothing written, nothing read — through raw NATS subjects and the CLI;
a revoked token and a removed user fail at once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from nats.js.errors import APIError, NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.applogs import LogLimits, app_log_subject, app_logs_stream, app_logs_stream_config
from shared.audit import read_entries
from shared.connection import Connection, connect
from shared.console_users import load_user as load_console_user
from shared.console_users import users_bucket
from shared.directget import last_per_subject
from shared.provisioning import create_or_update_stream
from shared.security.authority import RoleIssuer
from shared.security.authz import Authz
from shared.security.creds import read_user_jwt
from shared.security.join import JoinService
from shared.security.nkeyjwt import decode_claims
from shared.security.permissions import JOIN_ISSUE_SUBJECT, Role
from shared.subjects import EVENTS_STREAM, STATE_PREFIX, STATE_STREAM
from shared.teams import (
    DEPLOYER,
    OWNER,
    TEAMS_ISSUE_SUBJECT,
    VIEWER,
    Token,
    User,
    encode_token,
    hash_token,
    push_subject,
    token_key,
    token_user_name,
    user_key,
)
from shared.teams_store import delete_record as delete_team_record
from shared.teams_store import issue_member_creds, load_user, save_token, save_user
from shared.watch_server import serve_watches
from shared.watches import BadWatch, WatchSpec, follow, open_watch
from tests.e2e.cluster import cli_argv
from tests.security.conftest import ConnectAs, ManualClock, SecureCluster, answered_request
from tests.security.test_permissions import publish_refused
from tests.waiting import published

CLUSTER_TOO = True  # also on a secured three-server cluster (conftest.py): feeds, imports and replies cross routes
PA, PB = "p-alpha", "p-beta"
APP_A, APP_B = "a-alpha", "a-beta"
ENV_A, ENV_B = "e-alpha", "e-beta"


def project(pid: str, name: str) -> pb.Project:
    return pb.Project(meta=pb.Meta(id=pid), name=name)


def app(aid: str, pid: str) -> pb.App:
    return pb.App(meta=pb.Meta(id=aid), project_id=pid, name="web")


def env(eid: str, aid: str, pid: str, *, replicas: int = 1) -> pb.Environment:
    e = pb.Environment(meta=pb.Meta(id=eid), app_id=aid, project_id=pid, name="prod")
    e.effective_replicas = replicas
    return e


def secret(sid: str, eid: str, pid: str) -> pb.SealedSecret:
    return pb.SealedSecret(meta=pb.Meta(id=sid), environment_id=eid, project_id=pid, name=f"NAME_{sid}")


async def put(conn: Connection, msg: pb.Project | pb.App | pb.Environment | pb.SealedSecret) -> None:
    await conn.js.publish(f"{STATE_PREFIX}{K.key_of(msg)}", K.encode(msg))


async def stored(conn: Connection, key: str) -> bytes | None:
    try:
        msg = await conn.js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}{key}", direct=True)
    except NotFoundError:
        return None
    return None if (msg.headers or {}).get("KV-Operation") else bytes(msg.data)


def log_batch(env_id: str, line: str) -> bytes:
    batch = cpb.InstanceLogBatch(environment_id=env_id, instance_id="i1", node_id="n1")
    batch.lines.add(line=line, stream="stdout")
    return batch.SerializeToString(deterministic=True)


@dataclass
class Team:
    authz: Authz
    members: dict[str, str]  # member name -> creds path


@pytest.fixture
async def team(secure: SecureCluster, control: Connection, clock: ManualClock) -> AsyncIterator[Team]:
    directory = secure.setup.directory
    publics = json.loads((directory / "accounts.json").read_text())
    authz = Authz(
        control,
        publics["members"],
        issuer=RoleIssuer.load(directory, Role.MEMBER),
        admins_account=publics["operators"],
        now=clock,
    )
    issuers = {role: RoleIssuer.load(directory, role) for role in (Role.AGENT, Role.BUILDER)}
    service = JoinService(control, issuers, secure.setup.sentinel_jwt(), now=clock, authz=authz)
    ready = asyncio.Event()
    tasks = [
        asyncio.create_task(service.run()),
        asyncio.create_task(serve_watches(control, ready, authorize=authz.authorize_watch)),
    ]
    await asyncio.wait_for(service.ready.wait(), 10)
    await asyncio.wait_for(ready.wait(), 10)
    for msg in (
        project(PA, "alpha"),
        project(PB, "beta"),
        app(APP_A, PA),
        app(APP_B, PB),
        env(ENV_A, APP_A, PA),
        env(ENV_B, APP_B, PB),
        secret("s-a", ENV_A, PA),
        secret("s-b", ENV_B, PB),
    ):
        await put(control, msg)
    members: dict[str, str] = {}
    for name, role in (("olive", OWNER), ("dora", DEPLOYER), ("vera", VIEWER)):
        path = secure.creds(Role.MEMBER, name)
        key = str(decode_claims(read_user_jwt(path))["sub"])
        await save_user(control.js, User(name, key, False, {PA: role}))
        members[name] = path
    yield Team(authz, members)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def member(secure: SecureCluster, team: Team) -> AsyncIterator[dict[str, Connection]]:
    conns = {name: await connect(secure.url, name=f"member-{name}", creds=path) for name, path in team.members.items()}
    yield conns
    for conn in conns.values():
        await conn.close()


async def write(conn: Connection, key: str, value: bytes | None) -> dict[str, object]:
    """A raw KV write as the CLI makes it (relayed); the stream's or the relay's answer."""
    headers = {"KV-Operation": "DEL"} if value is None else None
    reply = await answered_request(conn, f"{STATE_PREFIX}{key}", value or b"", headers)
    answer: dict[str, object] = json.loads(reply.data)
    return answer


def refused(answer: dict[str, object], *words: str) -> bool:
    error = answer.get("error")
    description = str(error.get("description", "")) if isinstance(error, dict) else ""
    return description.startswith("not authorised") and all(w in description for w in words)


async def visible_keys(conn: Connection) -> set[str]:
    msgs = await last_per_subject(conn.nc, STATE_STREAM, f"{STATE_PREFIX}>", 5.0)
    return {(m.headers or {}).get("Nats-Subject", "").removeprefix(STATE_PREFIX) for m in msgs}


# ------------------------------------------------------------------------------------------------ reads


async def test_each_member_reads_only_its_projects_keys(control: Connection, member: dict[str, Connection]) -> None:
    everything = await visible_keys(control)
    assert {K.env(ENV_B), K.secret("s-b"), K.project(PB)} <= everything
    for name, conn in member.items():
        seen = await visible_keys(conn)
        assert {K.project(PA), K.app(APP_A), K.env(ENV_A), K.secret("s-a")} <= seen, name
        assert not any(k.endswith(("beta", "s-b")) for k in seen), (name, seen)
        # A single get of another project's key answers as a missing key: nothing read.
        with pytest.raises(NotFoundError):
            await conn.js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}{K.env(ENV_B)}", direct=True)
        own = await conn.js.get_last_msg(STATE_STREAM, f"{STATE_PREFIX}{K.env(ENV_A)}", direct=True)
        assert K.decode(K.ENV, own.data).project_id == PA


async def test_logs_are_followed_for_granted_environments_only(
    control: Connection, member: dict[str, Connection]
) -> None:
    for eid in (ENV_A, ENV_B):
        await create_or_update_stream(control.js, app_logs_stream_config(eid, LogLimits(1 << 20, 60.0), 1))
        await published(control.js, app_log_subject(eid, "i1"), log_batch(eid, f"line of {eid}"))
    viewer = member["vera"]
    watch = await follow(viewer, WatchSpec(app_logs_stream(ENV_A), (app_log_subject(ENV_A, "*"),), "all"))
    try:
        got = await watch.next_stored(5.0)
        assert got is not None and got.data == log_batch(ENV_A, f"line of {ENV_A}")
    finally:
        await watch.unsubscribe()
    info = await viewer.js.stream_info(app_logs_stream(ENV_A))
    assert info.state.messages >= 1
    with pytest.raises(BadWatch, match="not authorised"):
        await open_watch(viewer, WatchSpec(app_logs_stream(ENV_B), (app_log_subject(ENV_B, "*"),), "all"))
    with pytest.raises(BadWatch, match="not authorised: stream"):  # nor pushed to it
        await follow(viewer, WatchSpec(app_logs_stream(ENV_B), (app_log_subject(ENV_B, "*"),), "all"))
    with pytest.raises(APIError, match="not authorised"):
        await viewer.js.stream_info(app_logs_stream(ENV_B))
    # Neither events nor the state stream are followed by members (their payloads are not filtered).
    for spec in (WatchSpec(EVENTS_STREAM, ("zattera.events.>",)), WatchSpec(STATE_STREAM, (f"{STATE_PREFIX}>",))):
        with pytest.raises(BadWatch, match="not authorised"):
            await open_watch(viewer, spec)


# ----------------------------------------------------------------------------------------------- writes


async def test_a_viewer_writes_nothing(control: Connection, member: dict[str, Connection]) -> None:
    before = await stored(control, K.env(ENV_A))
    changed = env(ENV_A, APP_A, PA, replicas=5)
    assert refused(await write(member["vera"], K.env(ENV_A), K.encode(changed)), "viewer")
    assert refused(await write(member["vera"], K.secret("s-a"), None), "viewer")
    assert await stored(control, K.env(ENV_A)) == before
    assert await stored(control, K.secret("s-a")) is not None


async def test_a_deployer_changes_its_projects_environments_only(
    control: Connection, member: dict[str, Connection]
) -> None:
    dora = member["dora"]
    scaled = env(ENV_A, APP_A, PA, replicas=3)
    ack = await write(dora, K.env(ENV_A), K.encode(scaled))
    assert ack.get("seq"), ack
    assert K.decode(K.ENV, await stored(control, K.env(ENV_A)) or b"").effective_replicas == 3
    # Another project's env, moving an env into its project, creating an env, deleting an app, a cluster key.
    assert refused(await write(dora, K.env(ENV_B), K.encode(env(ENV_B, APP_B, PB, replicas=9))), PB)
    assert refused(await write(dora, K.env(ENV_B), K.encode(env(ENV_B, APP_B, PA))), PB)
    assert refused(await write(dora, K.env("e-new"), K.encode(env("e-new", APP_A, PA))), "owner")
    assert refused(await write(dora, K.app(APP_A), None), "owner")
    assert refused(await write(dora, K.node("n1"), b"x"), "admins only")
    assert K.decode(K.ENV, await stored(control, K.env(ENV_B)) or b"").effective_replicas == 1
    assert await stored(control, K.env("e-new")) is None
    assert await stored(control, K.app(APP_A)) is not None
    # Config: a secret of its project, set and deleted.
    assert (await write(dora, K.secret("s-new"), K.encode(secret("s-new", ENV_A, PA)))).get("seq")
    # Read at once after its write: the authorising path's index answers only once it holds the stream's last
    # revision (read-your-writes).
    assert K.secret("s-new") in await visible_keys(dora)
    assert (await write(dora, K.secret("s-new"), None)).get("seq")
    assert refused(await write(dora, K.secret("s-b"), None), PB)


async def test_an_owner_manages_its_project_but_not_the_cluster(
    control: Connection, member: dict[str, Connection]
) -> None:
    olive = member["olive"]
    assert (await write(olive, K.env("e-two"), K.encode(env("e-two", APP_A, PA)))).get("seq")
    assert (await write(olive, K.env("e-two"), None)).get("seq")
    assert await stored(control, K.env("e-two")) is None
    assert refused(await write(olive, K.project("p-new"), K.encode(project("p-new", "new"))), "admin")
    assert refused(await write(olive, K.app(APP_B), None), PB)
    assert await stored(control, K.project("p-new")) is None


async def test_raw_subjects_outside_the_members_permissions_are_refused(
    secure: SecureCluster, connect_as: ConnectAs, team: Team
) -> None:
    raw = await connect_as(Role.MEMBER, "vera")
    for subject in (
        f"$JS.API.CONSUMER.MSG.NEXT.{STATE_STREAM}.view-n1",
        # A member pulls no consumer at all, not even on its own environment's log stream (a drain's).
        f"$JS.API.CONSUMER.MSG.NEXT.{app_logs_stream(ENV_A)}.drain_datadog",
        f"$JS.API.CONSUMER.INFO.{app_logs_stream(ENV_A)}.drain_datadog",
        f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS_STREAM}.drain_datadog",  # a drain's durable consumer: not its
        "$JS.API.CONSUMER.MSG.NEXT.ZATTERA_GITHOOKS.githooks",
        "$JS.API.CONSUMER.INFO.ZATTERA_AUDIT.x",
        f"$JS.API.STREAM.MSG.GET.{STATE_STREAM}",
        f"{STATE_PREFIX}lease.scheduler",
        "zattera.agent.n1.snapshot",
    ):
        await raw.nc.publish(subject, b"{}", reply=raw.nc.new_inbox())
        assert await raw.refusal() == publish_refused(subject)
    await raw.nc.subscribe("zattera.events.>")
    assert "permissions violation for subscription" in await raw.refusal()
    # Its own pushed feeds only: another member's (or every) push subject is refused.
    other = str(decode_claims(read_user_jwt(team.members["olive"]))["sub"])
    for subject in (push_subject(other, "x"), "zattera.push.>"):
        await raw.nc.subscribe(subject)
        assert "permissions violation for subscription" in await raw.refusal()


# ----------------------------------------------------------------------------------------------- tokens


async def make_token(control: Connection, name: str, role: str, ttl: float, clock: ManualClock) -> str:
    creds, key = await issue_member_creds(control.nc, token_user_name(name))
    token = encode_token(creds)
    now = clock()
    await save_token(control.js, Token(name, PA, role, key, hash_token(token), now + ttl, now, "test"))
    return token


async def token_conn(secure: SecureCluster, token: str, tmp_path: object) -> Connection:
    from pathlib import Path

    from shared.security.creds import write_private
    from shared.teams import decode_token

    path = write_private(Path(str(tmp_path)) / "t.creds", decode_token(token))
    return await connect(secure.url, name="ci", creds=str(path))


async def test_a_token_acts_with_its_role_and_a_revoked_one_fails_at_once(
    secure: SecureCluster, control: Connection, team: Team, clock: ManualClock, tmp_path: object
) -> None:
    token = await make_token(control, "ci", DEPLOYER, 3600.0, clock)
    assert hash_token(token) not in token  # stored hashed; the token itself is nowhere in the bucket
    conn = await token_conn(secure, token, tmp_path)
    try:
        assert (await write(conn, K.env(ENV_A), K.encode(env(ENV_A, APP_A, PA, replicas=2)))).get("seq")
        assert K.env(ENV_A) in await visible_keys(conn)
        # Audited by name (the credential's name as the server set it).
        entries = await read_entries(control, idle=0.5)
        assert any(e.user == "token:ci" and any(k.key == K.env(ENV_A) for k in e.keys) for e in entries)
        stored_record = (await (await control.js.key_value("zattera-teams")).get(token_key("ci"))).value or b""
        assert token.encode() not in stored_record
        # Revoked: the very next write and read are refused.
        record = Token.from_json(stored_record)
        record.revoked = True
        await save_token(control.js, record)
        assert refused(await write(conn, K.env(ENV_A), K.encode(env(ENV_A, APP_A, PA, replicas=4))), "revoked")
        assert await visible_keys(conn) == set()
        # Expired: the same.
        later = await make_token(control, "ci2", VIEWER, 60.0, clock)
        conn2 = await token_conn(secure, later, tmp_path)
        try:
            assert K.env(ENV_A) in await visible_keys(conn2)
            clock.now += 61.0
            assert await visible_keys(conn2) == set()
        finally:
            await conn2.close()
    finally:
        await conn.close()
    assert K.decode(K.ENV, await stored(control, K.env(ENV_A)) or b"").effective_replicas == 2


async def test_a_removed_user_is_refused_at_its_next_request(
    control: Connection, member: dict[str, Connection]
) -> None:
    assert K.env(ENV_A) in await visible_keys(member["olive"])
    await delete_team_record(control.js, user_key("olive"))
    assert await visible_keys(member["olive"]) == set()
    answer = await write(member["olive"], K.env(ENV_A), K.encode(env(ENV_A, APP_A, PA)))
    assert refused(answer, "does not exist")


async def test_only_admins_get_member_credentials(member: dict[str, Connection], control: Connection) -> None:
    answer = await answered_request(member["olive"], TEAMS_ISSUE_SUBJECT, b'{"name": "x"}')
    assert "not authorised" in answer.data.decode() and "creds" not in json.loads(answer.data)
    creds, key = await issue_member_creds(control.nc, "someone")
    assert key.startswith("U") and "NKEY" in creds


# ---------------------------------------------------------------------------------------------------- CLI


async def cli(
    secure: SecureCluster, *args: str, token: str = "", creds: str = "", stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_")}
    environment |= {"ZATTERA_NATS_URL": secure.url, "HOME": os.environ.get("HOME", "/tmp")}
    if token:
        environment["ZATTERA_TOKEN"] = token
    if creds:
        environment["ZATTERA_NATS_CREDS"] = creds
    return await asyncio.to_thread(
        subprocess.run,
        [*cli_argv(), *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


async def test_the_cli_with_a_token_and_the_admin_commands(
    secure: SecureCluster, control: Connection, team: Team, tmp_path: object
) -> None:
    operator = str(secure.setup.operator_creds)
    made = await cli(
        secure,
        "tokens",
        "create",
        "deploy-ci",
        "--project",
        "alpha",
        "--role",
        "deployer",
        "--ttl",
        "1d",
        creds=operator,
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("ztk1_") and token not in made.stderr
    listed = await cli(secure, "tokens", "list", "--json", creds=operator)
    assert "deploy-ci" in listed.stdout and token not in listed.stdout and "sha256" not in listed.stdout

    envs = await cli(secure, "status", "--json", token=token)
    assert envs.returncode == 0, envs.stderr
    assert ENV_A in envs.stdout and ENV_B not in envs.stdout
    scaled = await cli(secure, "scale", "2", "--env", "alpha/web/prod", token=token)
    assert scaled.returncode == 0, scaled.stderr
    other = await cli(secure, "scale", "2", "--env", "beta/web/prod", token=token)
    assert other.returncode != 0 and "beta/web/prod" in other.stderr  # it does not even see it

    deployed = await cli(
        secure, "deploy", "--image", "docker.io/library/busybox:1", "--env", "alpha/web/prod", "--no-watch", token=token
    )
    assert deployed.returncode == 0, deployed.stderr
    deployment = await stored(control, K.deployment(deployed.stdout.strip()))
    assert deployment is not None and K.decode(K.DEPLOYMENT, deployment).project_id == PA
    elsewhere = await cli(
        secure, "deploy", "--image", "docker.io/library/busybox:1", "--env", "beta/web/prod", "--no-watch", token=token
    )
    assert elsewhere.returncode != 0 and "beta/web/prod" in elsewhere.stderr

    await create_or_update_stream(control.js, app_logs_stream_config(ENV_A, LogLimits(1 << 20, 60.0), 1))
    await published(control.js, app_log_subject(ENV_A, "i1"), log_batch(ENV_A, "hello from alpha"))
    logs = await cli(secure, "logs", "--env", "alpha/web/prod", "--json", token=token)
    assert logs.returncode == 0, logs.stderr
    assert "hello from alpha" in logs.stdout

    revoked = await cli(secure, "tokens", "revoke", "deploy-ci", creds=operator)
    assert revoked.returncode == 0, revoked.stderr
    before = await stored(control, K.env(ENV_A))
    after = await cli(secure, "scale", "3", "--env", "alpha/web/prod", token=token)
    assert after.returncode != 0
    assert await stored(control, K.env(ENV_A)) == before

    await users_bucket(control.js, create=True)  # as the console does when it starts
    added = await cli(
        secure,
        "users",
        "add",
        "carl",
        "--console",
        "--creds-out",
        f"{tmp_path}/carl.creds",
        creds=operator,
        stdin="carl's long password\n",
    )
    assert added.returncode == 0, added.stderr
    console_user = await load_console_user(control.js, "carl")  # one identity: the console login too
    assert console_user is not None and "long password" not in added.stdout + added.stderr
    granted = await cli(secure, "grants", "add", "carl", "--project", "beta", "--role", "viewer", creds=operator)
    assert granted.returncode == 0, granted.stderr
    carl = await cli(secure, "status", "--json", creds=f"{tmp_path}/carl.creds")
    assert carl.returncode == 0, carl.stderr
    assert ENV_B in carl.stdout and ENV_A not in carl.stdout
    grants = await cli(secure, "grants", "list", "--json", creds=operator)
    assert {"user": "carl", "project_id": PB, "role": "viewer"} in json.loads(grants.stdout)
    bad = await cli(secure, "grants", "add", "carl", "--project", "beta", "--role", "boss", creds=operator)
    assert bad.returncode != 0 and "--role" in bad.stderr
    removed = await cli(secure, "users", "remove", "carl", creds=operator)
    assert removed.returncode == 0, removed.stderr
    assert await load_console_user(control.js, "carl") is None
    gone = await cli(secure, "status", "--json", creds=f"{tmp_path}/carl.creds")
    assert ENV_B not in gone.stdout


async def test_a_steered_reply_of_the_authorising_path_stores_nothing(
    control: Connection, member: dict[str, Connection]
) -> None:
    """The answer to a member's read goes back through its import's reply mapping into MEMBERS (no stream)."""
    before = await stored(control, K.env(ENV_B))
    dora = member["dora"]
    for api in (
        f"$JS.API.DIRECT.GET.{STATE_STREAM}.{STATE_PREFIX}{K.env(ENV_A)}",
        f"$JS.API.STREAM.INFO.{STATE_STREAM}",
    ):
        await dora.nc.publish(api, b"", reply=f"{STATE_PREFIX}{K.env(ENV_B)}")
    await dora.nc.flush()
    # A marker write after the steered ones: once it is stored, the steered answers had their chance.
    assert (await write(dora, K.env(ENV_A), K.encode(env(ENV_A, APP_A, PA, replicas=7)))).get("seq")
    assert await stored(control, K.env(ENV_B)) == before


async def test_members_read_their_projects_events_only(
    secure: SecureCluster, control: Connection, member: dict[str, Connection]
) -> None:
    from shared.events import make_event
    from shared.teams import MemberEvents

    for project_id, n in ((PA, 1), (PB, 2), (PA, 3)):
        event = make_event("deploy.succeeded", f"event {n}", project_id=project_id)
        await control.js.publish("zattera.events.deploy.succeeded", event.SerializeToString())
    reader = MemberEvents(member["vera"].nc, "zattera.events.deploy.succeeded", 1)
    seen = [pb.Event.FromString((await reader.next_msg(5.0)).data) for _ in range(2)]
    assert [e.message for e in seen] == ["event 1", "event 3"]
    with pytest.raises(TimeoutError):
        await reader.next_msg(0.6)  # event 2 is project beta's: never read
    # Through the CLI, as the viewer.
    shown = await cli(secure, "events", "--json", creds=member_creds(secure, "vera"))
    assert shown.returncode == 0, shown.stderr
    assert "event 1" in shown.stdout and "event 3" in shown.stdout and "event 2" not in shown.stdout


def member_creds(secure: SecureCluster, name: str) -> str:
    return secure.creds(Role.MEMBER, name)


async def test_a_member_deploys_and_follows_its_deployment(
    secure: SecureCluster, control: Connection, team: Team
) -> None:
    """``zattera deploy`` with its watch (the default): the member's view is re-read from authorised snapshots."""
    from tests.waiting import eventually

    env_id = "e-follow"
    named = pb.Environment()
    named.CopyFrom(env(env_id, APP_A, PA))
    named.name = "follow"
    await put(control, named)
    command = asyncio.ensure_future(
        cli(
            secure,
            "deploy",
            "--image",
            "docker.io/library/busybox:1",
            "--env",
            "alpha/web/follow",
            creds=team.members["dora"],
        )
    )
    found: list[pb.Deployment] = []

    async def created() -> bool:
        msgs = await last_per_subject(control.nc, STATE_STREAM, f"{STATE_PREFIX}deployment.>", 5.0)
        found[:] = [d for d in (K.decode(K.DEPLOYMENT, m.data) for m in msgs if m.data) if d.environment_id == env_id]
        return bool(found)

    await eventually(created, timeout=60, what="the member's deployment")
    done = found[0]
    done.phase = pb.DEPLOYMENT_PHASE_SUCCEEDED  # as the orchestrator would
    await control.js.publish(f"{STATE_PREFIX}{K.deployment(done.meta.id)}", K.encode(done))
    result = await asyncio.wait_for(command, 60)
    assert result.returncode == 0, result.stderr
    assert "promoted" in result.stderr


# ------------------------------------------------------------------------------------------- admins (issue 39)


async def test_an_admin_member_does_the_cluster_wide_actions_until_its_flag_is_removed(
    secure: SecureCluster, control: Connection, member: dict[str, Connection]
) -> None:
    """``users add --admin``: one identity of the same kind (a member credential), authorised for every project
    and the cluster-wide actions by the same path, from its record read at each request."""
    path = member_creds(secure, "ada")
    key = str(decode_claims(read_user_jwt(path))["sub"])
    await save_user(control.js, User("ada", key, True, {}))
    ada = await connect(secure.url, name="member-ada", creds=path)
    vera = member["vera"]
    try:
        # Every project, and the cluster's keys.
        assert {K.env(ENV_A), K.env(ENV_B), K.secret("s-b")} <= await visible_keys(ada)
        assert (await write(ada, K.node("n9"), b"cordoned")).get("seq")
        assert (await write(ada, K.project("p-new"), K.encode(project("p-new", "new")))).get("seq")
        # Users, grants and tokens: the teams bucket and member credentials.
        await save_user(ada.js, User("newbie", "", False, {PA: VIEWER}))
        assert await load_user(control.js, "newbie") is not None
        _, newbie_key = await issue_member_creds(ada.nc, "newbie")
        assert newbie_key.startswith("U")
        # Nodes: a join token.
        issued = json.loads((await answered_request(ada, JOIN_ISSUE_SUBJECT, b'{"ttl": 60}')).data)
        assert "error" not in issued and issued.get("token"), issued
        # A member that is not an admin is refused each, nothing written.
        assert refused(await write(vera, K.node("n8"), b"x"), "admins only")
        with pytest.raises(APIError, match="not authorised"):
            await save_user(vera.js, User("sneaky", "", True, {}))
        assert await load_user(control.js, "sneaky") is None
        for subject in (JOIN_ISSUE_SUBJECT, TEAMS_ISSUE_SUBJECT):
            answer = (await answered_request(vera, subject, b'{"ttl": 60, "name": "x"}')).data.decode()
            assert "not authorised" in answer and "token" not in json.loads(answer), answer
        # The flag taken away: refused from the very next request.
        await save_user(control.js, User("ada", key, False, {}))
        assert refused(await write(ada, K.node("n9"), b"uncordoned"), "admins only")
        assert "not authorised" in (await answered_request(ada, JOIN_ISSUE_SUBJECT, b'{"ttl": 60}')).data.decode()
        assert K.env(ENV_B) not in await visible_keys(ada)
        assert await stored(control, K.node("n8")) is None
        assert await stored(control, K.node("n9")) == b"cordoned"
    finally:
        await ada.close()


# ------------------------------------------------------------------------------------ pushed feeds (issue 39)


async def test_a_members_state_changes_and_events_are_pushed_at_once(
    control: Connection, team: Team, member: dict[str, Connection], clock: ManualClock
) -> None:
    """No polling: a change arrives well under the old 0.5 s poll period, only its own projects'; a grant taken
    removed user's feed ends at its next message."""
    from shared.events import make_event
    from shared.watches import FeedWatch

    vera = member["vera"]
    states = await follow(vera, WatchSpec(STATE_STREAM, (f"{STATE_PREFIX}>",), "new"))
    events = await follow(vera, WatchSpec(EVENTS_STREAM, ("zattera.events.>",), "new"))
    try:
        assert isinstance(states, FeedWatch) and isinstance(events, FeedWatch)
        await asyncio.wait_for(states.caught_up.wait(), 5)
        await asyncio.wait_for(events.caught_up.wait(), 5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await put(control, env(ENV_B, APP_B, PB, replicas=4))  # another project's: never pushed to vera
        await put(control, env(ENV_A, APP_A, PA, replicas=6))
        got = await states.next_msg(5.0)
        state_after = loop.time() - started
        assert got.subject == f"{STATE_PREFIX}{K.env(ENV_A)}"
        assert K.decode(K.ENV, got.data).effective_replicas == 6
        started = loop.time()
        for project_id, text in ((PB, "beta's"), (PA, "alpha's")):
            event = make_event("deploy.succeeded", text, project_id=project_id)
            await control.js.publish("zattera.events.deploy.succeeded", event.SerializeToString())
        seen = pb.Event.FromString((await events.next_msg(5.0)).data)
        event_after = loop.time() - started
        assert seen.message == "alpha's"
        assert state_after < 0.25 and event_after < 0.25, (state_after, event_after)
        # The user removed: the next change ends the feed instead of reaching vera.
        await delete_team_record(control.js, user_key("vera"))
        clock.now += 2.0  # past FEED_RECHECK: the record is read again before the next message goes out
        await put(control, env(ENV_A, APP_A, PA, replicas=7))
        with pytest.raises(BadWatch, match="not authorised"):
            while True:
                await states.next_msg(5.0)
    finally:
        await states.unsubscribe()
        await events.unsubscribe()


async def test_an_admin_user_through_the_cli(
    secure: SecureCluster, control: Connection, team: Team, tmp_path: object
) -> None:
    """The operator credential bootstraps the first admin user; the admin user then manages the teams with its
    own member credential; ``users update --no-admin`` applies at its next command."""
    operator = str(secure.setup.operator_creds)
    root_creds = f"{tmp_path}/root.creds"
    added = await cli(secure, "users", "add", "root", "--admin", "--creds-out", root_creds, creds=operator)
    assert added.returncode == 0, added.stderr
    assert "(admin)" in added.stderr and "security creds operator" not in added.stderr
    claims = decode_claims(read_user_jwt(root_creds))
    assert claims["name"] == "root"  # a member credential like anyone's (MEMBERS account, member role key)
    bob = await cli(secure, "users", "add", "bob", "--creds-out", f"{tmp_path}/bob.creds", creds=root_creds)
    assert bob.returncode == 0, bob.stderr
    granted = await cli(secure, "grants", "add", "bob", "--project", "beta", "--role", "viewer", creds=root_creds)
    assert granted.returncode == 0, granted.stderr
    listed = await cli(secure, "users", "list", "--json", creds=root_creds)
    assert listed.returncode == 0, listed.stderr
    assert {u["name"]: u["grants"] for u in json.loads(listed.stdout)}["bob"] == {PB: "viewer"}
    # Bob (not an admin) may not do the same.
    refused_add = await cli(
        secure, "users", "add", "eve", "--creds-out", f"{tmp_path}/eve.creds", creds=f"{tmp_path}/bob.creds"
    )
    assert refused_add.returncode != 0 and "not authorised" in refused_add.stderr
    demoted = await cli(secure, "users", "update", "root", "--no-admin", creds=operator)
    assert demoted.returncode == 0, demoted.stderr
    again = await cli(secure, "users", "add", "carol", "--creds-out", f"{tmp_path}/carol.creds", creds=root_creds)
    assert again.returncode != 0 and "not authorised" in again.stderr
    assert await load_user(control.js, "carol") is None and await load_user(control.js, "eve") is None
