"""Databases declared in zattera.toml (``[addons.NAME]``): validated naming the field; ``apps apply`` creates
and attaches them through the same actions as ``zattera addons`` (shared/actions/addon_declare.py), on real
NATS; applying the same file again changes nothing; a name left out of ``attach`` is detached."""

from __future__ import annotations

import pytest

from cli.apply import ApplyResult, add_addon_steps, declared_addons, plan
from cli.spec import AppSpec, SpecError, validate
from shared.actions import addon_declare as declare
from shared.actions.addon_declare import apply_addons, plan_addons
from shared.actions.addons import list_addons
from shared.actions.context import ActionContext
from shared.actions.refusals import ActionRefused
from shared.addons import spec as addon
from shared.txn import Writer
from tests.actions.conftest import PATH, named
from tests.addons.test_actions import _key

BASE: dict[str, object] = {"project": "shop", "app": "web", "env": {"production": {}, "staging": {}}}


def _spec(addons: dict[str, object]) -> AppSpec:
    return validate({**BASE, "addons": addons})


@pytest.mark.parametrize(
    ("addons", "message"),
    [
        ({"db": {"type": "mysql"}}, "addons.db.type: unknown engine 'mysql': one of postgres, redis"),
        ({"db": {"type": "postgres", "version": "9"}}, "addons.db.version: postgres 9 is not available: 15"),
        ({"db": {"type": "postgres", "attach": ["web"]}}, "addons.db.attach: 'web' is not an env of this file"),
        ({"db": {"type": "postgres", "attach": ["x/y/z"]}}, "addons.db.attach: 'x/y/z' is not in project shop"),
        ({"db": {"type": "redis", "attach": ["staging", "staging"]}}, "addons.db.attach: an env is named twice"),
        ({"db": {"type": "redis", "size": 3}}, "addons.db.size: unknown key"),
        ({"db": {"version": "15"}}, "addons.db.type: Field required"),
        ({"Db": {"type": "redis"}}, "addons.Db: 'Db' must be 1-40 lowercase letters"),
        ({"web": {"type": "redis"}}, "addons.web: is this file's app"),
        ({"db": {"type": "postgres", "archive_timeout": 0}}, "addons.db.archive_timeout:"),
    ],
)
def test_a_bad_declaration_is_refused_naming_its_field(addons: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as refused:
        _spec(addons)
    assert message in str(refused.value)


async def _seed(writer: Writer) -> None:
    _, key = _key()
    await writer.commit(writer.txn().extend(creates=[*named(), key]))


async def test_apply_creates_and_attaches_then_a_second_apply_changes_nothing(
    ctx: ActionContext, writer: Writer
) -> None:
    await _seed(writer)
    spec = validate(
        {
            "project": "shop",
            "app": "web",
            "env": {"production": {}},
            "addons": {"db": {"type": "postgres", "attach": ["production"]}, "cache": {"type": "redis"}},
        }
    )
    declared = declared_addons(spec)
    before = plan_addons(ctx.view, "shop", "web", declared)
    assert [(s.action, s.database, s.env) for s in before] == [
        (declare.CREATE, "cache", ""),
        (declare.CREATE, "db", ""),
        (declare.ATTACH, "db", PATH),
    ]
    assert list_addons(ctx.view) == []  # planning writes nothing
    done = await apply_addons(ctx, "shop", "web", declared, deploy=False)
    assert [s.action for s in done.steps] == [declare.CREATE, declare.CREATE, declare.ATTACH]
    infos = {i.name: i for i in list_addons(ctx.view)}
    assert (infos["db"].engine, infos["cache"].engine) == ("postgres", "redis")
    assert infos["db"].attached_to == [PATH] and infos["cache"].attached_to == []
    env = ctx.view.env("01ENV")
    assert env is not None and "DATABASE_URL" in env.service.secrets and env.service.vars["PGUSER"] == "app"
    # the same file again: nothing to do, nothing written
    revision = ctx.view.last_revision
    again = await apply_addons(ctx, "shop", "web", declared, deploy=False)
    assert [s.action for s in again.steps] == [declare.UNCHANGED] * 3
    assert ctx.view.last_revision == revision
    # the plan lines apps apply prints
    result = ApplyResult()
    add_addon_steps(result, again.steps)
    assert [(i.action, i.kind, i.name) for i in result.items] == [
        ("unchanged", "database", "cache"),
        ("unchanged", "database", "db"),
        ("unchanged", "attachment", f"db → {PATH}"),
    ]
    # attach no longer names the env: it is detached (the database is kept)
    spec = validate({**BASE, "env": {"production": {}}, "addons": {"db": {"type": "postgres"}}})
    detached = await apply_addons(ctx, "shop", "web", declared_addons(spec), deploy=False)
    assert [(s.action, s.env) for s in detached.steps] == [(declare.UNCHANGED, ""), (declare.DETACH, PATH)]
    env = ctx.view.env("01ENV")
    assert env is not None and "DATABASE_URL" not in env.service.secrets
    assert {i.name for i in list_addons(ctx.view)} == {"db", "cache"}


async def test_apply_refuses_naming_the_files_key(ctx: ActionContext, writer: Writer) -> None:
    await _seed(writer)
    await apply_addons(ctx, "shop", "web", [declare.DeclaredAddon("db", addon.REDIS)], deploy=False)
    with pytest.raises(ActionRefused, match=r"^addons\.db\.type: db is a redis database already$"):
        await apply_addons(ctx, "shop", "web", [declare.DeclaredAddon("db", addon.POSTGRES)], deploy=False)
    with pytest.raises(ActionRefused, match=r"^addons\.db\.version: db runs redis 7"):
        plan_addons(ctx.view, "shop", "web", [declare.DeclaredAddon("db", addon.REDIS, "6")])
    # an app of that name that is no database
    with pytest.raises(ActionRefused, match=r"^addons\.web: 'web' is already an app of project shop$"):
        plan_addons(ctx.view, "shop", "other", [declare.DeclaredAddon("web", addon.REDIS)])
    # an env named in attach that does not exist: the attach action's refusal, named as the file's key
    with pytest.raises(ActionRefused, match=r"^addons\.db\.attach: "):
        await apply_addons(
            ctx, "shop", "web", [declare.DeclaredAddon("db", addon.REDIS, attach=("nope",))], deploy=False
        )


async def test_apps_apply_writes_the_envs_before_the_databases_attach_to_them(
    ctx: ActionContext, writer: Writer
) -> None:
    """A first apply of a file: the project, app and env do not exist yet when the databases are planned."""
    _, key = _key()
    await writer.commit(writer.txn().create(key))
    spec = validate({**BASE, "addons": {"db": {"type": "postgres", "attach": ["staging"]}}})
    txn, _ = plan(ctx.view, writer, spec)
    await writer.commit(txn)
    done = await apply_addons(ctx, "shop", "web", declared_addons(spec), deploy=False)
    assert [(s.action, s.env) for s in done.steps] == [(declare.CREATE, ""), (declare.ATTACH, "shop/web/staging")]
    assert list_addons(ctx.view)[0].attached_to == ["shop/web/staging"]
