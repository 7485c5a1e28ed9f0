"""``zattera git hook add|list|remove``: webhooks from GitHub, GitLab and Gitea (docs/git.md, "Webhooks and
previews"). The work is in :mod:`shared.actions.githooks`; the secrets service verifies deliveries and its
``githooks`` loop deploys.

The repository token is read from ``--token-file`` (never from the command line: it would be in the shell
history and the process listing); it is stored sealed with the hook's secret and never shown again. The
secret is printed once, on stdout.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import typer

from cli import render
from cli.client import err, fail, on_cluster, read_on_cluster, say
from cli.options import JSON, set_output
from shared.actions.githooks import AddHook, RemoveHook, add_hook, list_hooks, remove_hook
from shared.githooks import PROVIDERS

hook_app = typer.Typer(
    no_args_is_help=True, help="Webhooks from GitHub, GitLab and Gitea: push → deploy, pull request → preview."
)
"""``zattera git hook …`` (a group of :data:`cli.git_cmds.git_app`)."""


def _read_token(path: str) -> str:
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise fail(f"--token-file {path}: {exc.strerror or exc}") from None
    if not token:
        raise fail(f"--token-file {path}: the file is empty")
    return token


def _ttl(text: str) -> float:
    text = text.strip()
    if not text:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise fail(f"--preview-ttl {text!r}: give seconds or a number with s, m, h or d (e.g. 72h)") from None


@hook_app.command("add")
def add(
    env: str = typer.Option(..., "--env", help="the env a push to --branch deploys (project/app/env)"),
    provider: str = typer.Option(..., "--provider", help=" | ".join(PROVIDERS)),
    repo: str = typer.Option(..., "--repo", help="the repository's clone URL (no credentials in it)"),
    branch: str = typer.Option("main", "--branch", help="the branch deployed to --env"),
    token_file: str = typer.Option(
        "", "--token-file", help="a file holding the repository token (fetching a private repo, commit statuses)"
    ),
    previews: bool = typer.Option(False, "--previews", help="pull requests against --branch get env pr-<n>"),
    preview_label: str = typer.Option("", "--preview-label", help="only pull requests with this label"),
    preview_ttl: str = typer.Option("", "--preview-ttl", help="delete a preview this long after its last push"),
    share_secret: list[str] = typer.Option(
        [], "--share-secret", help="a secret of --env that previews get a copy of (repeatable)"
    ),
    api_url: str = typer.Option("", "--api-url", help="the provider's API base for commit statuses"),
    console_url: str = typer.Option(
        "", "--console-url", help="the console's address: the endpoint URL printed (default $ZATTERA_CONSOLE_URL)"
    ),
    json: bool = JSON,
) -> None:
    """Add a webhook to an env. Prints the endpoint URL and the secret (once) to paste in the git host's
    webhook settings (content type JSON; events: push, pull requests)."""
    set_output(json)
    request = AddHook(
        env=env,
        provider=provider,
        repo_url=repo,
        branch=branch,
        token=_read_token(token_file),
        previews=previews,
        preview_label=preview_label,
        preview_ttl=_ttl(preview_ttl),
        shared_secrets=share_secret,
        api_url=api_url,
        console_url=console_url or os.environ.get("ZATTERA_CONSOLE_URL", ""),
    )
    added = on_cluster(add_hook, request)
    if render.json_mode():
        render.emit_json({**dataclasses.asdict(added.hook), "url": added.url, "secret": added.secret})
        return
    h = added.hook
    preview = f", previews on{f' (label {h.preview_label})' if h.preview_label else ''}" if h.previews else ""
    err.print(f"hook {h.id} added: {h.provider} {h.repo_url} {h.branch} → {h.env}{preview}", markup=False)
    say(f"endpoint: {added.url}")
    field = "secret token" if h.provider == "gitlab" else "secret"
    say(f"webhook {field} (shown once; paste it in the hook's settings):")
    print(added.secret)


@hook_app.command("list")
def list_cmd(json: bool = JSON) -> None:
    """The hooks, their endpoints and live previews."""
    set_output(json)
    render.listing(
        "git hooks",
        ["id", "provider", "repo", "branch", "env", "path", "token", "previews", "live"],
        read_on_cluster(list_hooks),
        lambda h: [
            h.id,
            h.provider,
            h.repo_url,
            h.branch,
            h.env,
            h.path,
            "yes" if h.has_token else "no",
            (f"on{f' [{h.preview_label}]' if h.preview_label else ''}" if h.previews else "off"),
            ",".join(h.previews_live) or "-",
        ],
    )


@hook_app.command("remove")
def remove(hook_id: str = typer.Argument(..., metavar="HOOK_ID"), json: bool = JSON) -> None:
    """Remove a hook: its endpoint answers 404 from now on (its previews stay until closed, expired or
    deleted)."""
    set_output(json)
    on_cluster(remove_hook, RemoveHook(hook_id))
    render.report({"id": hook_id, "removed": True}, f"hook {hook_id} removed")
