"""``zattera users``, ``zattera grants``, ``zattera tokens``: teams on a secured cluster (docs/teams.md).

Run with the operator (admin) credential. A member's credential is minted by control (``zattera.teams.issue``)
and written 0600 to ``--creds-out``; a token is printed once on stdout and only its SHA-256 is stored.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from cli import render
from cli.client import control, fail, run, say
from cli.options import JSON
from shared.actions.names import resolve_project
from shared.security.creds import write_private
from shared.teams import (
    VIEWER,
    Token,
    User,
    check_name,
    check_role,
    encode_token,
    hash_token,
    parse_ttl,
    token_key,
    token_user_name,
    user_key,
)
from shared.teams_store import (
    all_records,
    delete_record,
    issue_member_creds,
    load_token,
    load_user,
    save_token,
    save_user,
)

users_app = typer.Typer(no_args_is_help=True, help="People of the teams: one identity for the CLI and console.")
grants_app = typer.Typer(no_args_is_help=True, help="Per-project roles of users: owner, deployer, viewer.")
tokens_app = typer.Typer(no_args_is_help=True, help="API tokens for CI: one project, one role, an expiry.")

USER = typer.Argument(..., help="the user")
PROJECT = typer.Option(..., "--project", help="project name or id")


R = TypeVar("R", User, Token)


async def _edited(
    js: Any,
    name: str,
    load: Callable[[Any, str], Awaitable[R | None]],
    save: Callable[[Any, R], Awaitable[None]],
    change: Callable[[R], bool],
) -> bool | None:
    """Load the user or token ``name``, change it and save it: None when there is none, False when ``change``
    found nothing to change (nothing is saved)."""
    found = await load(js, name)
    if found is None:
        return None
    if not change(found):
        return False
    await save(js, found)
    return True


def _edit(
    kind: str,
    name: str,
    load: Callable[[Any, str], Awaitable[R | None]],
    save: Callable[[Any, R], Awaitable[None]],
    change: Callable[[R], bool],
) -> None:
    """:func:`_edited` on the cluster, as one command: it fails when there is no ``kind`` (user, token)
    ``name``."""

    async def go() -> bool | None:
        async with control(view=False) as c:
            return await _edited(c.conn.js, name, load, save, change)

    if not run(go):
        raise fail(f"name {name!r}: no such {kind}")


def _records() -> tuple[list[User], list[Token]]:
    """Every user and every token of the cluster."""

    async def go() -> tuple[list[User], list[Token]]:
        async with control(view=False) as c:
            return await all_records(c.conn.nc, c.conn.js)

    return run(go)


def _checked(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ValueError as exc:
        raise fail(str(exc)) from None


@users_app.command("add")
def users_add(
    name: str = typer.Argument(..., help="user name: 1-64 of a-z, 0-9, '_', '.', '-'"),
    creds_out: Path = typer.Option(None, "--creds-out", help="where to write the credential (default NAME.creds)"),
    admin: bool = typer.Option(
        False, "--admin", help="a cluster admin: every project, nodes, the cluster key, users, grants and tokens"
    ),
    console: bool = typer.Option(
        False, "--console", help="also their console login (password from a prompt or stdin): one identity"
    ),
) -> None:
    """Add a person; writes their member credential (0600). Grant projects with `zattera grants add`."""
    _checked(check_name, name, "name")
    out = creds_out or Path(f"{name}.creds")
    console_user = None
    if console:
        from cli.console_cmds import _read_password
        from shared.console_users import ADMIN as CONSOLE_ADMIN
        from shared.console_users import new_user

        # The console's admin role: what a team user may do there is narrowed by their grants (docs/teams.md).
        console_user = _checked(new_user, name, CONSOLE_ADMIN, _read_password(name))

    async def go() -> None:
        async with control(view=False) as c:
            if await load_user(c.conn.js, name) is not None:
                raise fail(f"name {name!r}: the user exists (remove it first to re-issue its credential)")
            # One kind of identity for everyone: an admin's credential is a member credential like any other,
            # authorised for the cluster-wide actions by its record (read at every request).
            creds, key = await issue_member_creds(c.conn.nc, name)
            write_private(out, creds)
            await save_user(c.conn.js, User(name, key, admin, {}, time.time()))
            if console_user is not None:
                from shared.console_users import save_user as save_console_user

                await save_console_user(c.conn.js, console_user)

    run(go)
    what = " (admin)" if admin else ""
    say(f"user {name} added{what}; credential written to {out}")


@users_app.command("update")
def users_update(
    name: str = USER,
    admin: bool = typer.Option(..., "--admin/--no-admin", help="make the user a cluster admin, or not any more"),
) -> None:
    """Give or take the cluster admin role: effective at the user's next request."""

    def change(user: User) -> bool:
        user.admin = admin
        return True

    _edit("user", name, load_user, save_user, change)
    say(f"user {name} is {'an admin' if admin else 'not an admin'}")


@users_app.command("list")
def users_list(json: bool = JSON) -> None:
    """Users, whether admin, and their grants (project id → role)."""
    users = _records()[0]
    rows = [{"name": u.name, "admin": u.admin, "grants": u.grants, "created_at": u.created_at} for u in users]
    if json:
        render.emit_json(rows)
        return
    render.table(
        "users",
        ["name", "admin", "grants"],
        [
            [r["name"], "yes" if r["admin"] else "", ", ".join(f"{p}={g}" for p, g in u.grants.items())]
            for r, u in zip(rows, users, strict=True)
        ],
    )


@users_app.command("remove")
def users_remove(name: str) -> None:
    """Remove a user and their console login: both are refused from their next request."""

    async def go() -> bool:
        async with control(view=False) as c:
            if await load_user(c.conn.js, name) is None:
                return False
            await delete_record(c.conn.js, user_key(name))
            # One identity: their console login goes too (else it would act unscoped, as before teams).
            from shared.console_users import remove_user as remove_console_user

            await remove_console_user(c.conn.js, name)
            return True

    if not run(go):
        raise fail(f"name {name!r}: no such user")
    say(f"user {name} removed")


def _project_id(view: Any, ref: str) -> str:
    project = resolve_project(view, ref)
    if project is None:
        raise fail(f"--project {ref!r}: no such project")
    return str(project.meta.id)


def _grant(user: User, project_id: str, role: str) -> bool:
    """Give ``user`` ``role`` on the project ("": take their role away); False when they had none to take."""
    if role:
        user.grants[project_id] = role
        return True
    return user.grants.pop(project_id, None) is not None


def _set_role(user: str, project: str, role: str, missing: str) -> tuple[str, bool]:
    """Give ``user`` ``role`` on ``project`` ("": take their role away): the project's id, and whether that
    changed the user; ``missing`` is the error when there is no such user."""

    async def go() -> tuple[str, bool]:
        async with control() as c:
            project_id = _project_id(c.view, project)
            done = await _edited(c.conn.js, user, load_user, save_user, lambda u: _grant(u, project_id, role))
            if done is None:
                raise fail(missing)
            return project_id, done

    return run(go)


@grants_app.command("add")
def grants_add(
    user: str = USER,
    project: str = PROJECT,
    role: str = typer.Option(VIEWER, "--role", help="owner, deployer or viewer"),
) -> None:
    """Give USER a role on a project (replaces the role they had there)."""
    _checked(check_role, role)
    project_id, _ = _set_role(user, project, role, f"user {user!r}: no such user (`zattera users add`)")
    say(f"{user} is {role} of project {project} ({project_id})")


@grants_app.command("remove")
def grants_remove(
    user: str = USER,
    project: str = PROJECT,
) -> None:
    """Take USER's role on a project away (effective at their next request)."""
    if not _set_role(user, project, "", f"user {user!r}: no such user")[1]:
        raise fail(f"user {user!r} has no role on project {project!r}")
    say(f"{user} has no role on project {project} any more")


@grants_app.command("list")
def grants_list(
    user: str = typer.Option("", "--user", help="only this user"),
    json: bool = JSON,
) -> None:
    """Every grant: user, project id, role."""
    rows = [
        {"user": u.name, "project_id": p, "role": r}
        for u in _records()[0]
        if not user or u.name == user
        for p, r in sorted(u.grants.items())
    ]
    if json:
        render.emit_json(rows)
        return
    render.table("grants", ["user", "project", "role"], [[r["user"], r["project_id"], r["role"]] for r in rows])


@tokens_app.command("create")
def tokens_create(
    name: str = typer.Argument(..., help="token name (shown in the audit log as token:NAME)"),
    project: str = PROJECT,
    role: str = typer.Option(..., "--role", help="owner, deployer or viewer"),
    ttl: str = typer.Option("90d", "--ttl", help="lifetime: a number and s, m, h or d"),
) -> None:
    """Create an API token and print it once (use it as ZATTERA_TOKEN); only its hash is stored."""
    _checked(check_name, name, "name")
    _checked(check_role, role)
    seconds = _checked(parse_ttl, ttl)

    async def go() -> str:
        async with control() as c:
            project_id = _project_id(c.view, project)
            if await load_token(c.conn.js, name) is not None:
                raise fail(f"name {name!r}: a token of that name exists (revoke it, or pick another name)")
            creds, key = await issue_member_creds(c.conn.nc, token_user_name(name))
            token = encode_token(creds)
            now = time.time()
            record = Token(name, project_id, role, key, hash_token(token), now + seconds, now, "operator")
            await save_token(c.conn.js, record)
            return token

    token = run(go)
    say(f"token {name} ({role} of {project}, {ttl}); shown once:")
    print(token)


@tokens_app.command("list")
def tokens_list(json: bool = JSON) -> None:
    """Tokens: name, project, role, expiry, revoked (never the token nor its hash)."""
    tokens = [t.public() for t in _records()[1]]
    if json:
        render.emit_json(tokens)
        return
    render.table(
        "tokens",
        ["name", "project", "role", "expires", "revoked"],
        [
            [
                t["name"],
                t["project_id"],
                t["role"],
                _utc(t["expires_at"]),
                "yes" if t["revoked"] else "",
            ]
            for t in tokens
        ],
    )


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


@tokens_app.command("revoke")
def tokens_revoke(name: str) -> None:
    """Revoke a token: refused from its next request."""

    def revoke(token: Token) -> bool:
        token.revoked = True
        return True

    _edit("token", name, load_token, save_token, revoke)
    say(f"token {name} revoked")


__all__ = ["grants_app", "token_key", "tokens_app", "users_app"]
