"""``zattera git remote|map|unmap|branches``: the app's git remote on the console and which branch deploys
which env (docs/git.md)."""

from __future__ import annotations

import json
import os
from urllib.parse import quote

import typer

from cli import render
from cli.client import control, err, fail, run
from cli.githook_cmds import hook_app
from cli.options import JSON, env_or_fail, set_output
from shared.actions.gitmap import map_branch
from shared.actions.names import env_path
from shared.console_users import users_bucket

git_app = typer.Typer(
    no_args_is_help=True,
    help="Deploys from git (docs/git.md): the app's git push remote, its branch → env map, and webhooks.",
)
git_app.add_typer(hook_app, name="hook")

ENDPOINT_KEY = "git.endpoint"
"""Where the console records its URL (services/console/git.py writes it)."""


def remote_url(console_url: str, project: str, app: str, user: str = "") -> str:
    """``http://[user@]host:port/git/<project>/<app>.git`` (no password: git asks, or a credential helper)."""
    scheme, _, rest = console_url.rstrip("/").partition("://")
    who = f"{quote(user, safe='')}@" if user else ""
    return f"{scheme}://{who}{rest}/git/{project}/{app}.git"


@git_app.command("remote")
def remote(
    env: str = typer.Option(..., "--env", help="environment id or project/app/env"),
    user: str = typer.Option("", "--user", help="console user to put in the URL (asked by git otherwise)"),
    url: str = typer.Option("", "--url", help="the console's URL (default: $ZATTERA_CONSOLE_URL, else as recorded)"),
    json_output: bool = JSON,
) -> None:
    """Print the git remote URL of the env's app: `git remote add zattera $(zattera git remote --env E)`."""
    set_output(json_output, False)

    async def go() -> dict[str, str]:
        async with control() as c:
            target = env_or_fail(c.view, env)
            project, app, name = env_path(c.view, target).split("/", 2)
            base = url or os.environ.get("ZATTERA_CONSOLE_URL", "")
            if not base:
                kv = await users_bucket(c.conn.js, create=False)
                entry = None
                if kv is not None:
                    try:
                        entry = await kv.get(ENDPOINT_KEY)
                    except Exception:
                        entry = None
                if entry is None or not entry.value:
                    raise fail("no console has recorded its URL yet: start the console, or give --url")
                base = str(json.loads(entry.value)["url"])
            return {
                "remote": remote_url(base, project, app, user),
                "env": f"{project}/{app}/{name}",
                "branch": target.git_branch,
            }

    found = run(go)
    if render.json_mode():
        render.emit_json(found)
        return
    print(found["remote"])
    if not found["branch"]:
        err.print(f"note: no branch deploys {found['env']} yet: zattera git map main --env {found['env']}")


@git_app.command("map")
def map_cmd(
    branch: str = typer.Argument(..., metavar="BRANCH", help="a git branch name, e.g. main"),
    env: str = typer.Option(..., "--env", help="environment id or project/app/env"),
) -> None:
    """Make pushes of BRANCH deploy the env (replaces the env's previous branch)."""

    async def go() -> None:
        async with control() as c:
            done = await map_branch(c.actions, env, branch)
            err.print(f"branch {branch} → {done.env}" + ("" if done.changed else " (unchanged)"), highlight=False)

    run(go)


@git_app.command("unmap")
def unmap_cmd(env: str = typer.Option(..., "--env", help="environment id or project/app/env")) -> None:
    """No branch deploys the env any more."""

    async def go() -> None:
        async with control() as c:
            done = await map_branch(c.actions, env, "")
            err.print(f"{done.env}: no branch deploys it" + ("" if done.changed else " (unchanged)"), highlight=False)

    run(go)


@git_app.command("branches")
def branches(json_output: bool = JSON) -> None:
    """Every env a branch deploys, by app."""
    set_output(json_output, False)

    async def go() -> list[dict[str, str]]:
        async with control() as c:
            rows = [{"env": env_path(c.view, e), "branch": e.git_branch} for e in c.view.envs() if e.git_branch]
            return sorted(rows, key=lambda r: r["env"])

    rows = run(go)
    if render.json_mode():
        render.emit_json(rows)
        return
    render.table("git branches", ["env", "branch"], [[r["env"], r["branch"]] for r in rows])
