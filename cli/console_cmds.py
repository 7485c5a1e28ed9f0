"""``zattera console add-user|list-users|remove-user``: the web console's users (docs/console.md).

A password comes from a prompt (asked twice) or stdin; it is hashed with bcrypt here and only the hash
is stored, in the ``zattera-console`` KV bucket. It is never printed, logged or put in an error.
"""

from __future__ import annotations

import getpass
import sys

import typer

from cli import render
from cli.client import control, fail, run, say
from cli.options import JSON
from shared.console_users import (
    ADMIN,
    ROLES,
    NoUsersBucket,
    UserError,
    list_users,
    new_user,
    remove_user,
    save_user,
)

console_app = typer.Typer(no_args_is_help=True, help="Web console users (`python -m services.console`).")


def _read_password(name: str) -> str:
    if sys.stdin.isatty():
        first = getpass.getpass(f"password for {name}: ")
        if getpass.getpass(f"password for {name} (again): ") != first:
            raise fail("password: the two entries differ; nothing was changed")
        return first
    return sys.stdin.readline().removesuffix("\n")


@console_app.command("add-user")
def add_user(
    name: str = typer.Argument(..., help="user name: 1-64 of a-z, 0-9, '_', '.', '-'"),
    role: str = typer.Option(ADMIN, "--role", help=f"one of {', '.join(ROLES)} (a viewer cannot act)"),
) -> None:
    """Add a console user, or set an existing one's password and role; the password comes from a prompt
    or the first line of stdin."""
    try:
        user = new_user(name, role, _read_password(name))
    except UserError as exc:
        raise fail(str(exc)) from None

    async def go() -> None:
        async with control(view=False) as c:
            try:
                await save_user(c.conn.js, user)
            except NoUsersBucket as exc:
                raise fail(str(exc)) from None

    run(go)
    say(f"console user {name} saved ({role})")


@console_app.command("list-users")
def list_users_cmd(json: bool = JSON) -> None:
    """Console users and their roles (never their password hashes)."""

    async def go() -> list[dict[str, object]]:
        async with control(view=False) as c:
            return [u.as_json() for u in await list_users(c.conn.js)]

    users = run(go)
    if json:
        render.emit_json(users)
        return
    render.table("console users", ["name", "role"], [[u["name"], u["role"]] for u in users])


@console_app.command("remove-user")
def remove_user_cmd(name: str) -> None:
    """Remove a console user (a running console refuses their open sessions from their next request)."""

    async def go() -> bool:
        async with control(view=False) as c:
            return await remove_user(c.conn.js, name)

    if not run(go):
        raise fail(f"console user {name!r} not found")
    say(f"console user {name} removed")
