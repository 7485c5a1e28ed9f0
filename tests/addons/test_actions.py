"""The add-on actions (shared/actions/addons.py) on real NATS: a create is one write of the database's app,
env and sealed secrets plus its first deploy; attach hands the consumer sealed copies (never a plaintext)
and rolls it out; a restore is a fork pinned to the origin's node; bad input is refused naming the field,
and a failed create leaves nothing behind."""

from __future__ import annotations

import time

import pytest
from nacl.public import PrivateKey, SealedBox
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.addon_attach import AttachAddon, attach_addon, detach_addon
from shared.actions.addon_restore import restore_addon
from shared.actions.addons import CreateAddon, DeleteAddon, RestoreAddon, create_addon, delete_addon, list_addons
from shared.actions.context import ActionContext
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.addons import spec as addon
from shared.deploy import Deployer
from shared.secrets import CLUSTER_KEY, key_id
from shared.txn import Writer
from tests import factories
from tests.actions.conftest import ENV_ID, PATH, named


def _key() -> tuple[PrivateKey, pb.SecretsKey]:
    private = PrivateKey.generate()
    record = pb.SecretsKey(key_id=key_id(bytes(private.public_key)), public_key=bytes(private.public_key))
    record.meta.id = CLUSTER_KEY
    return private, record


def _open(private: PrivateKey, secret: pb.SealedSecret) -> str:
    return SealedBox(private).decrypt(secret.ciphertext).decode()


async def _seed(writer: Writer, *, running: bool = False) -> PrivateKey:
    private, record = _key()
    extra = [factories.release("01REL1", ENV_ID)] if running else []
    await writer.commit(
        writer.txn().extend(creates=[*named(active_release_id="01REL1" if running else ""), record, *extra])
    )
    return private


def _secrets(ctx: ActionContext, env_id: str) -> dict[str, pb.SealedSecret]:
    env = ctx.view.env(env_id)
    assert env is not None
    by_id = {s.meta.id: s for s in ctx.view.secrets(env_id)}
    return {name: by_id[ref.secret_id] for name, ref in env.service.secrets.items()}


async def test_create_writes_the_database_env_with_sealed_generated_passwords_and_deploys_it(
    ctx: ActionContext, writer: Writer
) -> None:
    private = await _seed(writer)
    created = await create_addon(ctx, CreateAddon("postgres", "orders", "shop"))
    info = created.info
    assert (info.engine, info.version, info.env, info.address) == (
        "postgres",
        "15",
        "shop/orders/db",
        "orders.db.shop.internal:5432",
    )
    env = ctx.view.env(info.env_id)
    assert env is not None and env.service.stateful
    assert [v.volume_name for v in env.service.volumes] == ["data", "backups"]
    assert env.service.healthcheck.type == pb.HEALTH_CHECK_TYPE_EXEC and "select 1" in env.service.healthcheck.command
    deployment = ctx.view.deployment(created.deployment_id)
    assert deployment is not None
    release = ctx.view.release(deployment.release_id)
    assert release is not None and release.image_ref == addon.IMAGE_REF
    sealed = _secrets(ctx, info.env_id)
    assert set(sealed) == {"POSTGRES_PASSWORD", "APP_PASSWORD", "ZATTERA_ADDON_URL"}
    app_password = _open(private, sealed["APP_PASSWORD"])
    assert len(app_password) == 32 and _open(private, sealed["POSTGRES_PASSWORD"]) != app_password
    assert _open(private, sealed["ZATTERA_ADDON_URL"]) == (
        f"postgresql://app:{app_password}@${{ZATTERA_SERVICE_ORDERS_DB_HOST}}:${{ZATTERA_SERVICE_ORDERS_DB_PORT}}/app"
    )
    # no plaintext anywhere in the env or its release (the entry script is in a plain variable)
    for message in (env, release):
        assert app_password.encode() not in message.SerializeToString()
    assert [i.name for i in list_addons(ctx.view, "shop")] == ["orders"]


@pytest.mark.parametrize(
    ("request_", "error", "field"),
    [
        (CreateAddon("mysql", "x", "shop"), Invalid, "engine"),
        (CreateAddon("postgres", "x", "shop", version="9"), Invalid, "version"),
        (CreateAddon("postgres", "Bad_Name", "shop"), Invalid, "name"),
        (CreateAddon("postgres", "x", "nope"), NotFound, "project"),
        (CreateAddon("postgres", "web", "shop"), Conflicting, "name"),  # the app web exists
        (CreateAddon("postgres", "x", "shop", archive_timeout=0), Invalid, "archive_timeout"),
    ],
)
async def test_bad_input_is_refused_naming_the_field_and_writes_nothing(
    ctx: ActionContext, writer: Writer, request_: CreateAddon, error: type[Exception], field: str
) -> None:
    await _seed(writer)
    before = ctx.view.count(K.APP), ctx.view.count(K.ENV)
    with pytest.raises(error) as refused:
        await create_addon(ctx, request_)
    assert getattr(refused.value, "field", None) == field
    assert "\n" not in str(refused.value)
    assert (ctx.view.count(K.APP), ctx.view.count(K.ENV)) == before


async def test_a_create_whose_first_deploy_fails_leaves_nothing_behind(
    ctx: ActionContext, writer: Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app, env and sealed secrets are committed before the first deploy: when that deploy is refused (here
    a deploy that raises after the records landed), they are removed again and the refusal reaches the caller."""
    await _seed(writer)
    before = ctx.view.count(K.APP), ctx.view.count(K.ENV), ctx.view.count(K.SECRET)
    seen: list[str] = []

    async def refused_deploy(self: Deployer, env_id: str, **_: object) -> object:
        seen.append(env_id)
        assert ctx.view.env(env_id) is not None  # the records were written first
        raise Conflicting("the cluster refused the deploy", field="name")

    monkeypatch.setattr(Deployer, "deploy", refused_deploy)
    with pytest.raises(Conflicting, match="refused the deploy"):
        await create_addon(ctx, CreateAddon("postgres", "orders", "shop"))
    assert len(seen) == 1 and ctx.view.env(seen[0]) is None
    assert ctx.view.secrets(seen[0]) == []
    assert (ctx.view.count(K.APP), ctx.view.count(K.ENV), ctx.view.count(K.SECRET)) == before


async def test_attach_gives_sealed_copies_and_rolls_the_env_out_then_detach_removes_them(
    ctx: ActionContext, writer: Writer
) -> None:
    private = await _seed(writer, running=True)
    created = await create_addon(ctx, CreateAddon("postgres", "orders", "shop"))
    changed = await attach_addon(ctx, AttachAddon("orders", PATH))
    assert changed.deployed and changed.deployment_id
    consumer = _secrets(ctx, ENV_ID)
    database = _secrets(ctx, created.info.env_id)
    assert _open(private, consumer["DATABASE_URL"]) == _open(private, database["ZATTERA_ADDON_URL"])
    assert _open(private, consumer["PGPASSWORD"]) == _open(private, database["APP_PASSWORD"])
    env = ctx.view.env(ENV_ID)
    assert env is not None
    assert env.service.vars["PGHOST"] == "${ZATTERA_SERVICE_ORDERS_DB_HOST}" and env.service.vars["PGUSER"] == "app"
    assert list_addons(ctx.view)[0].attached_to == [PATH]
    with pytest.raises(Conflicting) as again:
        await attach_addon(ctx, AttachAddon("orders", PATH, deploy=False))
    assert again.value.field == "name"
    with pytest.raises(Conflicting, match="attached to shop/web/production: detach first"):
        await delete_addon(ctx, DeleteAddon("orders", "shop"))
    await detach_addon(ctx, AttachAddon("orders", PATH, deploy=False))
    env = ctx.view.env(ENV_ID)
    assert env is not None
    assert not {"DATABASE_URL", "PGPASSWORD"} & set(env.service.secrets)
    assert not {"PGHOST", "PGUSER", addon.attached_var("orders")} & set(env.service.vars)
    # delete keeps the volumes (the backups) unless --purge; attaching to a deleted database is refused
    await delete_addon(ctx, DeleteAddon("orders", "shop"))
    with pytest.raises(NotFound) as gone:
        await attach_addon(ctx, AttachAddon("orders", PATH))
    assert gone.value.field == "name" and "deleted" in str(gone.value)


async def test_a_restore_is_a_fork_pinned_to_the_origins_node_and_refuses_times_outside_the_window(
    ctx: ActionContext, writer: Writer
) -> None:
    await _seed(writer)
    created = await create_addon(ctx, CreateAddon("postgres", "orders", "shop"))
    with pytest.raises(Conflicting, match="no backups yet"):
        await restore_addon(ctx, RestoreAddon("orders", "shop", "orders-copy"))
    backups = pb.Volume(
        project_id="01PROJ",
        environment_id=created.info.env_id,
        name="backups",
        node_id="n1",
        status=pb.VOLUME_STATUS_ACTIVE,
    )
    backups.meta.id = "01VOLBACKUPS"
    await writer.commit(writer.txn().create(backups))
    now = time.time()
    with pytest.raises(Invalid) as future:
        await restore_addon(ctx, RestoreAddon("orders", "shop", "orders-copy", to_time=now + 3600))
    assert future.value.field == "to_time" and "in the future" in str(future.value)
    with pytest.raises(Invalid) as early:
        await restore_addon(ctx, RestoreAddon("orders", "shop", "orders-copy", to_time=now - 86400))
    assert early.value.field == "to_time" and "before the recoverable window" in str(early.value)
    with pytest.raises(NotFound) as unknown:
        await restore_addon(ctx, RestoreAddon("nope", "shop", "orders-copy"))
    assert unknown.value.field == "name"

    fork = await restore_addon(ctx, RestoreAddon("orders", "shop", "orders-copy", to_time=time.time()))
    env = ctx.view.env(fork.info.env_id)
    assert env is not None
    assert env.service.vars[addon.FORK_VOLUME_VAR] == "01VOLBACKUPS"
    assert env.service.vars["ZATTERA_PG_RESTORE_STANZA"] == "orders"
    assert env.service.vars["ZATTERA_PG_STANZA"] == "orders-copy"
    assert fork.info.restored_from == "shop/orders"
    assert {v.name: v.node_id for v in ctx.view.volumes(fork.info.env_id)} == {"data": "n1", "backups": "n1"}
    # the origin is untouched
    origin = ctx.view.env(created.info.env_id)
    assert origin is not None and origin.meta == ctx.view.env(created.info.env_id).meta  # type: ignore[union-attr]
    assert [v.name for v in ctx.view.volumes(created.info.env_id)] == ["backups"]


def test_the_window_comes_from_the_instances_report_and_bounds_the_target() -> None:
    from shared.actions.addon_restore import check_restore_time
    from shared.addons.backups import status_from_lines

    info = (
        '[{"name":"orders","backup":[{"label":"20261202-100000F","type":"full","error":false,'
        '"timestamp":{"start":1000,"stop":1010},"info":{"size":30,"repository":{"size":4}},'
        '"archive":{"start":"A","stop":"B"}}]}]'
    )
    status = status_from_lines(
        [(1020.0, f"zattera-addon-backups {info}"), (1100.0, "zattera-addon-archived time=1090.5 wal=W failed=0")]
    )
    assert status is not None
    assert (status.window_start, status.window_end, status.last_archived_wal) == (1010.0, 1090.5, "W")
    assert [b.label for b in status.backups] == ["20261202-100000F"]
    check_restore_time(1050.0, 900.0, 2000.0, status)  # inside
    check_restore_time(1105.0, 900.0, 2000.0, status)  # after the reported end, but newer than the report
    with pytest.raises(Invalid, match="before the recoverable window"):
        check_restore_time(1005.0, 900.0, 2000.0, status)
    later = status_from_lines(
        [(1020.0, f"zattera-addon-backups {info}"), (1200.0, "zattera-addon-archived time=1090.5 wal=W failed=0")]
    )
    with pytest.raises(Invalid, match="after the last archived WAL"):
        check_restore_time(1150.0, 900.0, 2000.0, later)
    assert status_from_lines([(1.0, "something else")]) is None


async def test_a_redis_database_gets_a_sealed_password_and_attaches_as_redis_url(
    ctx: ActionContext, writer: Writer
) -> None:
    private = await _seed(writer, running=True)
    created = await create_addon(ctx, CreateAddon("redis", "cache", "shop"))
    assert (created.info.engine, created.info.version, created.info.address) == (
        "redis",
        "7",
        "cache.db.shop.internal:6379",
    )
    env = ctx.view.env(created.info.env_id)
    assert env is not None and [v.volume_name for v in env.service.volumes] == ["data"]
    sealed = _secrets(ctx, created.info.env_id)
    assert set(sealed) == {"REDIS_PASSWORD", "ZATTERA_ADDON_URL"}
    password = _open(private, sealed["REDIS_PASSWORD"])
    await attach_addon(ctx, AttachAddon("cache", PATH))
    consumer = _secrets(ctx, ENV_ID)
    assert set(consumer) == {"REDIS_URL"}
    assert _open(private, consumer["REDIS_URL"]) == (
        f"redis://default:{password}@${{ZATTERA_SERVICE_CACHE_DB_HOST}}:${{ZATTERA_SERVICE_CACHE_DB_PORT}}/0"
    )
    with pytest.raises(Invalid, match="point-in-time restore is PostgreSQL's"):
        await restore_addon(ctx, RestoreAddon("cache", "shop", "cache-copy"))
