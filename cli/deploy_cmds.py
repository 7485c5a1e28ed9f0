"""``zattera deploy DIR|watch|cancel|list``, ``zattera rollback`` and ``zattera releases``: releases and
the deployments that roll them out."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import control, err, fail, run
from cli.options import JSON, WIDE, env_or_fail, set_output
from cli.render import Col
from shared.actions.context import ActionContext
from shared.actions.deploys import (
    CanaryDecision,
    CanaryRequested,
    CancelDeployment,
    Deploy,
    GitCommit,
    Rollback,
    abort_canary,
    cancel_deployment,
    promote_canary,
)
from shared.actions.deploys import deploy as deploy_action
from shared.actions.deploys import rollback as rollback_action
from shared.actions.names import env_label, env_path
from shared.deploy import DeployError
from shared.deploysource import SourceRefused, default_env, inspect_source, mismatch
from shared.gitsource import head_commit
from shared.state.reader import StateReader
from shared.telemetry import span


def _deploy_usage(ctx: Any) -> str:
    prog = ctx.command_path
    return (
        f"Usage: {prog} DIR [--env E] [OPTIONS]\n"
        f"       {prog} --env E (--image REF | --build ID) [OPTIONS]\n"
        f"       {prog} (watch | cancel | promote | abort | list) [ARGS]..."
    )


class _DeployContext(typer.Context):
    @property
    def command_path(self) -> str:
        return super().command_path.removesuffix(" run")


class _DeployCommand(TyperCommand):
    """The deploy itself, reached as ``zattera deploy DIR --env E``: its name ``run`` is an internal detail
    that neither its usage nor its error hints show."""

    context_class = _DeployContext

    def get_usage(self, ctx: Any) -> str:
        return _deploy_usage(ctx)


class _DeployHelp(TyperGroup):
    def get_usage(self, ctx: Any) -> str:
        return _deploy_usage(ctx)


class _DeployGroup(TyperGroup):
    """``zattera deploy DIR ...`` deploys; ``zattera deploy watch|cancel|list ...`` are subcommands. The help
    shows the deploy's own arguments and options first, then those subcommands."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands:
            args = ["run", *args]
        return super().resolve_command(ctx, args)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        run = self.commands["run"]
        _DeployHelp(
            name=self.name,
            commands={name: command for name, command in self.commands.items() if name != "run"},
            params=[*run.params, *self.get_params(ctx)],
            help=self.help,
            rich_markup_mode=self.rich_markup_mode,
        ).format_help(ctx, formatter)


deploy_app = typer.Typer(
    cls=_DeployGroup,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    no_args_is_help=True,
    help="Deploy a source directory or an image (zattera deploy DIR --env E); watch, cancel or list deployments.",
)


_OPTION_OF_FIELD = {"image_ref": "--image", "build_id": "--build", "to_release_id": "--to"}


def _refused(exc: DeployError, given: dict[str, str]) -> typer.Exit:
    """A refused deploy or rollback, naming the option it is about when there is one (``given``: each option
    typed → its value), e.g. ``--to '01J…': target release not found in this environment``."""
    option = _OPTION_OF_FIELD.get(exc.field, "")
    if option not in given:
        return fail(str(exc))
    return fail(f"{option} {given[option]!r}: {exc.problem}")


@deploy_app.command("run", cls=_DeployCommand, hidden=True)
def deploy(
    ctx: typer.Context,
    source: Path = typer.Argument(None, metavar="DIR", help="source directory to build and deploy"),
    env: str = typer.Option(
        "", "--env", help="environment id or project/app/env (default: DIR's zattera.toml, when it names one env)"
    ),
    image: str = typer.Option("", "--image", help="deploy this image instead of building source"),
    build: str = typer.Option("", "--build", help="deploy the image of a finished build"),
    watch: bool = typer.Option(True, "--watch/--no-watch", help="follow the deployment until it is live"),
    force: bool = typer.Option(False, "--force", help="deploy DIR even though its zattera.toml names another app"),
) -> None:
    """Deploy: from a source directory (tar, upload, build, deploy), or --image / --build."""
    from cli.source import pack, upload

    if sum(bool(x) for x in (source, image, build)) != 1:
        raise fail("give exactly one of SOURCE, --image or --build")
    manifest = None
    if source is not None:
        try:
            manifest, _ = inspect_source(source)  # the builder's checks, before anything is uploaded
        except SourceRefused as exc:
            raise fail(str(exc)) from None
    try:
        env = env or default_env(manifest) if manifest is not None else env
    except SourceRefused as exc:
        raise typer.BadParameter(str(exc), ctx=ctx, param_hint="--env") from None
    if not env:
        raise typer.BadParameter("required with --image or --build", ctx=ctx, param_hint="--env")

    async def go() -> str:
        async with control() as c:
            target = env_or_fail(c.view, env)
            if manifest is not None and (problem := mismatch(manifest, env_path(c.view, target), env)):
                if not force:
                    raise fail(problem)
                err.print(f"--force: {replaced(c.view, target, manifest.app_path)}", highlight=False)
            request = Deploy(target.meta.id, image_ref=image, build_id=build)
            if source is not None:
                try:
                    data = pack(source)
                except ValueError as exc:
                    raise fail(str(exc)) from None
                digest = await upload(c.conn, data)
                err.print(f"uploaded source {digest[:19]}… ({len(data):,} bytes)")
                head = head_commit(source)  # DIR is a git checkout: the release records its HEAD commit
                commit = (
                    GitCommit(
                        head.sha,
                        branch=head.branch,
                        ref=f"refs/heads/{head.branch}" if head.branch else "",
                        author=head.author,
                        message=head.message,
                    )
                    if head is not None
                    else None
                )
                if head is not None:
                    err.print(
                        f"commit {head.sha[:12]} ({head.branch or 'detached'}): {commit_subject(head.message)}",
                        highlight=False,
                        markup=False,
                    )
                request = Deploy(target.meta.id, tarball_digest=digest, commit=commit)
            try:
                done = await deploy_action(c.actions, request)
            except DeployError as exc:
                raise _refused(exc, {o: v for o, v in (("--image", image), ("--build", build)) if v}) from None
            err.print(f"deployment {done.deployment_id} created: release v{done.release_version} of {done.env}")
            return done.deployment_id

    # The root of the deploy's trace: the writes carry its traceparent, and every service that reacts to
    # them (builds, orchestrator, scheduler, agents) continues it.
    with span("cli.deploy", env=env, source=str(source) if source else None, image=image or None) as current:
        deployment_id = run(go)
        current.set_attribute("deployment", deployment_id)
    if watch:
        _watch(deployment_id, until_done=False)
    else:
        print(deployment_id)


def commit_subject(message: str, limit: int = 72) -> str:
    """A commit message's first line, cut to ``limit`` characters."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first if len(first) <= limit else first[: limit - 1] + "…"


def replaced(view: StateReader, target: pb.Environment, source_app: str) -> str:
    """What a forced deploy of another app's source replaces, in one line."""
    active = view.release(target.active_release_id) if target.active_release_id else None
    what = f"its active release v{active.version}" if active else "nothing yet (no active release)"
    return f"deploying {source_app}'s source into {env_path(view, target)}, replacing {what}"


@deploy_app.command("watch")
def deploy_watch(
    deployment_id: str,
    until_done: bool = typer.Option(False, "--until-done", help="wait for SUCCEEDED, past the drain window"),
) -> None:
    """Follow a deployment's phases (and its build's log) until it is live or has failed."""
    _watch(deployment_id, until_done=until_done)


def _watch(deployment_id: str, *, until_done: bool) -> None:
    from cli.watch import watch_deployment

    code = run(lambda: watch_deployment(deployment_id, until_done=until_done))
    raise typer.Exit(code)


@deploy_app.command("promote")
def deploy_promote(deployment_id: str, json: bool = JSON) -> None:
    """Canary: skip the remaining steps and send all the traffic to the new release now."""
    _canary(deployment_id, promote_canary, json)


@deploy_app.command("abort")
def deploy_abort(deployment_id: str, json: bool = JSON) -> None:
    """Canary: send no more traffic to the new release and stop its replicas (deployment.canary_aborted)."""
    _canary(deployment_id, abort_canary, json)


def _canary(
    deployment_id: str, action: Callable[[ActionContext, CanaryDecision], Awaitable[CanaryRequested]], json: bool
) -> None:
    async def go() -> None:
        async with control() as c:
            done = await action(c.actions, CanaryDecision(deployment_id))
            if set_output(json):
                render.emit_json(
                    {"deployment_id": done.deployment_id, "requested": done.requested, "step": done.step}
                    | {"weight": done.weight}
                )
                return
            err.print(
                f"deployment {done.deployment_id}: {done.requested} requested at canary step {done.step + 1} "
                f"({done.weight}%)"
            )

    run(go)


@deploy_app.command("cancel")
def deploy_cancel(deployment_id: str) -> None:
    """Cancel a deployment: before promotion it fails with the green set removed; while draining the
    old release it finishes the drain now."""

    async def go() -> None:
        async with control() as c:
            done = await cancel_deployment(c.actions, CancelDeployment(deployment_id))
            err.print(f"deployment {done.deployment_id}: cancel requested ({done.phase.lower()})")

    run(go)


def rollback(
    env: str = typer.Option(..., "--env", help="environment id or project/app/env"),
    to: str = typer.Option("", "--to", help="release id (default: the highest version below the active one)"),
    watch: bool = typer.Option(True, "--watch/--no-watch"),
) -> None:
    """Roll an environment back to an earlier release."""

    async def go() -> str:
        async with control() as c:
            try:
                done = await rollback_action(c.actions, Rollback(env, to_release_id=to))
            except DeployError as exc:
                raise _refused(exc, {"--to": to} if to else {}) from None
            err.print(f"rollback {done.deployment_id} to v{done.release_version} created")
            return done.deployment_id

    with span("cli.rollback", env=env) as current:
        deployment_id = run(go)
        current.set_attribute("deployment", deployment_id)
    if watch:
        _watch(deployment_id, until_done=False)


def releases(env: str = typer.Option(..., "--env"), json: bool = JSON, wide: bool = WIDE) -> None:
    """The releases of an environment, newest first."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            target = env_or_fail(c.view, env)
            render.listing(
                f"releases of {env_path(c.view, target)}",
                [
                    "version",
                    "id",
                    "image",
                    "config",
                    "commit",
                    "author",
                    Col("message", wrap=True),
                    "created",
                    "active",
                ],
                sorted(c.view.releases(target.meta.id), key=lambda r: r.version, reverse=True),
                lambda r: [
                    f"v{r.version}",
                    r.meta.id,
                    r.image_ref or "(building)",
                    f"v{r.service.config_version}",
                    r.source.git_sha[:12],
                    r.source.git_author,
                    commit_subject(r.source.git_message),
                    render.ts(r.meta.created_at),
                    "*" if r.meta.id == target.active_release_id else "",
                ],
            )

    run(go)


@deploy_app.command("list")
def deployments(env: str = typer.Option("", "--env"), json: bool = JSON, wide: bool = WIDE) -> None:
    """Deployments (of one environment, or all), newest first."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            target = env_or_fail(c.view, env) if env else None

            def row(d: pb.Deployment) -> list[Any]:
                release = c.view.release(d.release_id)
                return [
                    d.meta.id,
                    env_label(c.view, d.environment_id),
                    f"v{release.version}" if release else "?",
                    render.enum_name(pb.DeploymentPhase, d.phase, "DEPLOYMENT_PHASE_"),
                    "rollback" if d.is_rollback else "",
                    d.error,
                ]

            render.listing(
                "deployments",
                ["id", "env", "release", "phase", "kind", Col("error", wrap=True)],
                list(reversed(c.view.deployments(target.meta.id if target else None))),
                row,
            )

    run(go)
