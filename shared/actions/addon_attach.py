"""Attaching a managed database to an env and detaching it (``zattera addons attach|detach``, docs/addons.md).

Attaching gives an env the database's URL as a sealed secret (``DATABASE_URL``/``REDIS_URL``; a copy of the
database's own sealed ``ZATTERA_ADDON_URL``, so no plaintext is needed) and, for PostgreSQL, ``PGPASSWORD``
(sealed) and ``PGHOST``/``PGPORT``/``PGUSER``/``PGDATABASE``, in the one reconfiguring write that rolls the
env out red/green. The address in them is a reference the consumer's node fills in
(``${ZATTERA_SERVICE_<NAME>_DB_HOST}``): each consumer reaches the database at its own private address.
"""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.addons import EVENT_ATTACHED, EVENT_DETACHED, addon_env, cluster_key, sealed_secret
from shared.actions.config import ConfigChanged, reconfigure
from shared.actions.context import ActionContext
from shared.actions.fields import EnvRef, Rollout
from shared.actions.names import env_path, resolve_env, target_env
from shared.actions.refusals import Conflicting, Invalid, NotFound
from shared.addons import spec as addon
from shared.deploy import ConfigEdit
from shared.state.reader import StateReader
from shared.txn import Txn


@dataclass(frozen=True, slots=True)
class AttachAddon:
    name: str
    env: EnvRef
    """The env that gets the URL (the database is looked up in its project)."""
    deploy: Rollout = True


def _consumer_and_addon(view: StateReader, request: AttachAddon) -> tuple[pb.Environment, pb.Environment]:
    consumer = target_env(view, request.env)
    project = view.project(consumer.project_id)
    assert project is not None
    database = addon_env(view, project, request.name)
    if database.meta.id == consumer.meta.id:
        raise Invalid("env", "a database cannot be attached to itself")
    return consumer, database


async def attach_addon(ctx: ActionContext, request: AttachAddon) -> ConfigChanged:
    consumer, database = _consumer_and_addon(ctx.view, request)
    engine, _ = addon.addon_of(database) or ("", "")
    app = ctx.view.app(database.app_id)
    assert app is not None
    url_name = addon.url_name(engine)
    marker = addon.attached_var(app.name)
    plain = addon.consumer_vars(engine, app.name)

    def edit(env: pb.Environment, txn: Txn) -> None:
        if env.service.vars.get(marker) == database.meta.id:
            raise Conflicting(f"{app.name} is already attached to this env", field="name")
        taken = [n for n in (url_name, "PGPASSWORD", *plain) if n in env.service.vars or n in env.service.secrets]
        if taken:
            raise Conflicting(f"the env already sets {', '.join(taken)} (detach the other database first)", field="env")
        key = cluster_key(ctx.view)
        by_id = {s.meta.id: s for s in ctx.view.secrets(database.meta.id)}
        url_ref = database.service.secrets.get(addon.URL_SECRET)
        url = by_id.get(url_ref.secret_id) if url_ref is not None else None
        if url is None or url.key_id != key.key_id:
            raise Conflicting(f"{app.name}'s URL is not sealed to the current cluster key yet; try again", field="name")
        txn.create(sealed_secret(env, key, url_name, ciphertext=url.ciphertext))
        if engine == addon.POSTGRES:
            password_ref = database.service.secrets[addon.APP_PASSWORD]
            password = by_id[password_ref.secret_id]
            txn.create(sealed_secret(env, key, "PGPASSWORD", ciphertext=password.ciphertext))
        env.service.vars.update({**plain, marker: database.meta.id})
        env.service.config_version += 1
        txn.put(key)

    fields = {"addon": app.name, "addon_env_id": database.meta.id}
    return await _reconfigured(
        ctx, consumer, edit, request.deploy, EVENT_ATTACHED, f"database {app.name} attached to", fields
    )


async def detach_addon(ctx: ActionContext, request: AttachAddon) -> ConfigChanged:
    consumer = target_env(ctx.view, request.env)
    project = ctx.view.project(consumer.project_id)
    assert project is not None
    marker = addon.attached_var(request.name)
    if marker not in consumer.service.vars:
        raise NotFound(f"{request.name} is not attached to {env_path(ctx.view, consumer)}", field="name")
    database = resolve_env(ctx.view, consumer.service.vars[marker])
    engine = (addon.addon_of(database) or (addon.POSTGRES, ""))[0] if database is not None else addon.POSTGRES
    names = [addon.url_name(engine), *(["PGPASSWORD"] if engine == addon.POSTGRES else [])]
    plain = [*addon.consumer_vars(engine, request.name), marker]

    def edit(env: pb.Environment, txn: Txn) -> None:
        for name in names:
            ref = env.service.secrets.pop(name, None)
            if ref is not None:
                txn.delete(K.secret(ref.secret_id))
        for name in plain:
            env.service.vars.pop(name, None)
        env.service.config_version += 1

    said = f"database {request.name} detached from"
    return await _reconfigured(ctx, consumer, edit, request.deploy, EVENT_DETACHED, said, {"addon": request.name})


async def _reconfigured(
    ctx: ActionContext,
    consumer: pb.Environment,
    edit: ConfigEdit,
    deploy: bool,
    kind: str,
    said: str,
    fields: dict[str, str],
) -> ConfigChanged:
    """Commit ``edit`` to the consumer (its rollout when ``deploy``) and announce it: ``said`` the env."""
    changed = await reconfigure(ctx, consumer.meta.id, edit, deploy=deploy)
    await ctx.announce(kind, f"{said} {changed.env}", env=consumer, **fields)
    return changed
