"""The ``zattera`` command line: the operator interface.

Every read command accepts ``--json``; every write goes through the fenced-write layer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from google.protobuf.message import Message
from typer.core import TyperCommand, TyperGroup
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.apply import env_label, env_path, plan, resolve_env
from cli.build_cmds import build_app
from cli.client import OPTIONS, Control, control, err, run
from cli.cluster_cmds import cluster_app
from cli.config_cmds import config_app
from cli.console_cmds import console_app
from cli.context_cmds import context_app
from cli.domains_cmds import domains_app
from cli.env_cmds import apps_delete, envs_app, placement_status, print_unplaced, projects_app, scale, status
from cli.events_cmds import announce_scale_changes, events, publish_node_change, replica_counts
from cli.images_cmds import images_app
from cli.jobs_cmds import jobs_app, run_command
from cli.logs_cmds import logs
from cli.network_cmds import network
from cli.plan_view import print_plan
from cli.render import Col
from cli.secrets_cmds import secrets_app
from cli.security_cmds import join_token, secure_up, security_app
from cli.spec import SpecError, load
from cli.up import DEFAULT_METRICS_PORT, Cluster, run_up
from services.proxy.settings import DEFAULT_HOST as DEFAULT_PROXY_HOST
from services.proxy.settings import DEFAULT_TLS_LISTEN as DEFAULT_PROXY_TLS_LISTEN
from services.proxy.settings import split_listen
from shared import keys as K
from shared.applogs import describe_exit
from shared.deploy import Deployer, DeployError
from shared.deployments import desired_replicas, is_terminal
from shared.settings import settings
from shared.state.reader import StateReader
from shared.telemetry import setup as setup_telemetry
from shared.telemetry import span
from shared.txn import Conflict

app = typer.Typer(no_args_is_help=True, help="Zattera: a self-hosted PaaS control plane on NATS JetStream.")
nodes_app = typer.Typer(no_args_is_help=True, help="Machines: list, label, cordon, drain.")
nodes_app.command("join-token")(join_token)
apps_app = typer.Typer(no_args_is_help=True, help="Apps and environments from zattera.toml.")


def _deploy_usage(ctx: Any) -> str:
    prog = ctx.command_path
    return (
        f"Usage: {prog} DIR --env E [OPTIONS]\n"
        f"       {prog} --env E (--image REF | --build ID) [OPTIONS]\n"
        f"       {prog} (watch | cancel | list) [ARGS]..."
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
builds_app = typer.Typer(no_args_is_help=True, help="Builds and their logs.")
volumes_app = typer.Typer(no_args_is_help=True, help="Volumes and their snapshots.")
app.add_typer(deploy_app, name="deploy")
app.add_typer(nodes_app, name="nodes")
app.add_typer(apps_app, name="apps")
app.add_typer(builds_app, name="builds")
app.add_typer(build_app, name="build")
app.add_typer(volumes_app, name="volumes")
app.add_typer(security_app, name="security")
app.add_typer(config_app, name="config")
app.add_typer(secrets_app, name="secrets")
app.add_typer(domains_app, name="domains")
app.command("logs")(logs)
app.command()(events)
app.add_typer(cluster_app, name="cluster")
app.add_typer(context_app, name="context")
app.add_typer(jobs_app, name="jobs")
app.command("network")(network)
app.command("run", context_settings={"allow_interspersed_args": False})(run_command)

app.add_typer(images_app, name="images")
app.add_typer(console_app, name="console")

JSON = typer.Option(False, "--json", help="machine-readable output")
WIDE = typer.Option(False, "--wide", help="every column, ids included")


@app.callback()
def root(
    nats: str = typer.Option("", "--nats", envvar="ZATTERA_NATS_URL", help="NATS URL(s), comma-separated"),
) -> None:
    """Zattera: a self-hosted PaaS control plane on NATS JetStream."""
    OPTIONS.nats_url = nats
    setup_telemetry("zattera-cli")  # OTEL_TRACES_EXPORTER picks the exporter; unset = no-op


def _json(flag: bool, wide: bool = False) -> bool:
    OPTIONS.json = flag
    OPTIONS.wide = wide
    return flag


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print("[red]error:[/] ", end="")
    err.print(message, markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


_OPTION_OF_FIELD = {"image_ref": "--image", "build_id": "--build", "to_release_id": "--to"}


def _refused(exc: DeployError, given: dict[str, str]) -> typer.Exit:
    """A refused deploy or rollback, naming the option it is about when there is one (``given``: each option
    typed → its value), e.g. ``--to '01J…': target release not found in this environment``."""
    option = _OPTION_OF_FIELD.get(exc.field, "")
    if option not in given:
        return _fail(str(exc))
    return _fail(f"{option} {given[option]!r}: {exc.problem}")


def _env_or_fail(view: StateReader, ref: str) -> pb.Environment:
    env = resolve_env(view, ref)
    if env is None:
        raise _fail(f"--env: no environment {ref!r} (use an id or project/app/env)")
    return env


# ---------------------------------------------------------------------------------------------- cluster


@app.command()
def up(
    data_dir: Path = typer.Option(None, help="where NATS data and logs live (default: $ZATTERA_DATA_DIR or .zattera)"),
    port: int = typer.Option(4222, help="NATS client port (a free one is used when busy)"),
    secure: bool = typer.Option(False, help="NATS accounts and per-role credentials (SECURITY.md)"),
    tls: bool = typer.Option(False, help="TLS on the NATS listener with a generated local CA (implies --secure)"),
    nats_cluster: int = typer.Option(
        1, "--nats-cluster", min=1, max=5, help="local NATS servers as one JetStream cluster (3: replicas=3)"
    ),
    proxy_port: int = typer.Option(8080, help="HTTP port of the local ingress proxy"),
    proxy_listen: str = typer.Option(
        "",
        "--proxy-listen",
        envvar="ZATTERA_PROXY_LISTEN",
        help="HOST:PORT of the local ingress proxy (default 0.0.0.0:<proxy-port>: every interface)",
    ),
    proxy_tls_listen: str = typer.Option(
        DEFAULT_PROXY_TLS_LISTEN,
        "--proxy-tls-listen",
        envvar="ZATTERA_PROXY_TLS_LISTEN",
        help="HOST:PORT of the proxy's HTTPS listener (haproxy engine; certificates: docs/certificates.md); '' = none",
    ),
    node: bool = typer.Option(True, "--node/--no-node", help="also run a local agent and the proxy"),
    all_in_one: bool = typer.Option(
        True, "--all-in-one/--separate", help="the control plane in one process, or one process per service"
    ),
    metrics_port: int = typer.Option(
        DEFAULT_METRICS_PORT, min=0, max=65535, help="Prometheus metrics from this port up, one per process; 0 = off"
    ),
) -> None:
    """Start the whole single-machine cluster: embedded NATS and every service, until Ctrl-C."""
    directory = (data_dir or settings().data_dir).resolve()
    proxy_host = DEFAULT_PROXY_HOST
    if proxy_listen:
        try:
            proxy_host, proxy_port = split_listen(proxy_listen)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--proxy-listen") from None
    if proxy_tls_listen:
        try:
            tls_host, tls_port = split_listen(proxy_tls_listen)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--proxy-tls-listen") from None
        if proxy_tls_listen == DEFAULT_PROXY_TLS_LISTEN and proxy_host != tls_host:
            # --proxy-listen 127.0.0.1:… keeps the proxy on this machine: HTTPS too, unless told otherwise.
            proxy_tls_listen = f"[{proxy_host}]:{tls_port}" if ":" in proxy_host else f"{proxy_host}:{tls_port}"
    if (secure or tls) and nats_cluster > 1:
        raise typer.BadParameter("--secure/--tls run one NATS server; drop --nats-cluster", param_hint="--nats-cluster")
    if secure or tls:
        raise typer.Exit(
            secure_up(
                directory,
                port,
                tls=tls,
                proxy_port=proxy_port,
                proxy_host=proxy_host,
                proxy_tls_listen=proxy_tls_listen,
                with_node=node,
                metrics_port=metrics_port,
                all_in_one=all_in_one,
            )
        )
    cluster = Cluster(
        data_dir=directory,
        port=port,
        nats_cluster=nats_cluster,
        proxy_port=proxy_port,
        proxy_host=proxy_host,
        proxy_tls_listen=proxy_tls_listen,
        with_node=node,
        metrics_port=metrics_port,
        all_in_one=all_in_one,
    )
    raise typer.Exit(run_up(cluster))


# ---------------------------------------------------------------------------------------------- nodes


@nodes_app.command("list")
def nodes_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Every registered node with its status, capacity and reservations."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            nodes = c.view.nodes()
            if render.json_mode():
                render.messages(nodes)
                return
            rows = []
            for n in nodes:
                cpu, mem = c.view.reserved(n.meta.id)
                rows.append(
                    [
                        n.meta.id,
                        n.name,
                        render.enum_name(pb.NodeStatus, n.status, "NODE_STATUS_"),
                        "yes" if n.schedulable else "cordoned",
                        n.os_arch,
                        n.runtime or "process",
                        f"{cpu}/{n.capacity.cpu_millis or '∞'} m",
                        f"{mem}/{n.capacity.memory_mb or '∞'} MB",
                        ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())),
                    ]
                )
            render.table(
                "nodes",
                [
                    "id",
                    "name",
                    "status",
                    "schedulable",
                    "platform",
                    "runtime",
                    "cpu",
                    "memory",
                    Col("labels", wrap=True),
                ],
                rows,
            )

    run(go)


async def _commit_edit(c: Control, what: str, edit: Callable[[], Message | None]) -> Message | None:
    """Commit ``edit()`` — a record decided on the current view, None when there is nothing to write — and
    decide again when a concurrent write won (the scheduler renews leases and heartbeats land meanwhile).
    Returns what was written."""
    for _ in range(10):
        edited = edit()
        if edited is None:
            return None
        try:
            await c.writer.commit(c.writer.txn().put(edited))
            return edited
        except Conflict:
            await asyncio.sleep(0.05)
    raise _fail(f"{what} kept changing; try again")


def _edit_node(node_id: str, change: str, labels: dict[str, str] | None = None) -> None:
    async def go() -> None:
        async with control() as c:
            decided_on: list[tuple[pb.Node, int]] = []

            def edit() -> pb.Node | None:
                node = c.view.node(node_id)
                if node is None:
                    raise _fail(f"node {node_id!r} not found")
                decided_on[:] = [(node, c.view.rev(K.node(node_id)))]
                edited = pb.Node()
                edited.CopyFrom(node)
                if change == "cordon":
                    if node.status in (pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED):
                        err.print(
                            f"node {node_id} is {render.enum_name(pb.NodeStatus, node.status, 'NODE_STATUS_')}:"
                            " nothing to do"
                        )
                        return None
                    edited.schedulable = False
                elif change == "uncordon":
                    if node.status == pb.NODE_STATUS_DOWN:
                        raise _fail(f"node {node_id} is down: it cannot be uncordoned until it heartbeats again")
                    edited.status = pb.NODE_STATUS_ALIVE
                    edited.schedulable = True
                elif change == "drain":
                    edited.status = pb.NODE_STATUS_DRAINING
                    edited.schedulable = False
                elif change == "label":
                    for key, value in (labels or {}).items():
                        if value:
                            edited.labels[key] = value
                        else:
                            edited.labels.pop(key, None)
                return edited

            edited = await _commit_edit(c, f"node {node_id}", edit)
            if isinstance(edited, pb.Node):
                await publish_node_change(c.conn, *decided_on[0], edited)
                err.print(f"node {node_id}: {change} done")

    run(go)


@nodes_app.command("cordon")
def nodes_cordon(node_id: str) -> None:
    """Stop placing new replicas on a node (running ones stay)."""
    _edit_node(node_id, "cordon")


@nodes_app.command("uncordon")
def nodes_uncordon(node_id: str) -> None:
    """Make a node schedulable again."""
    _edit_node(node_id, "uncordon")


@nodes_app.command("drain")
def nodes_drain(node_id: str) -> None:
    """Move every replica off a node, then mark it DRAINED."""
    _edit_node(node_id, "drain")


@nodes_app.command("label")
def nodes_label(node_id: str, labels: list[str] = typer.Argument(..., help="key=value (key= removes)")) -> None:
    """Set or remove node labels (used by placement constraints and region spread)."""
    parsed: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _fail(f"labels: {item!r} is not key=value")
        parsed[key] = value
    _edit_node(node_id, "label", parsed)


# ---------------------------------------------------------------------------------------------- apps


@apps_app.command("apply")
def apps_apply(
    path: Path = typer.Argument(Path("zattera.toml")),
    json: bool = JSON,
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would change, field by field; write nothing"),
) -> None:
    """Create or update the project, app and environments described by a zattera.toml (docs/zattera-toml.md)."""
    _json(json)
    try:
        spec = load(path)
    except SpecError as exc:
        raise _fail(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, an unreadable file, not UTF-8
        raise _fail(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None

    async def go() -> None:
        async with control() as c:
            for _ in range(5):
                counts = replica_counts(c.view)
                try:
                    txn, result = plan(c.view, c.writer, spec)
                except ValueError as exc:
                    raise _fail(str(exc)) from None
                if dry_run:
                    break
                try:
                    await c.writer.commit(txn)
                    await announce_scale_changes(c.conn, counts, c.view)
                    break
                except Conflict:
                    await asyncio.sleep(0.05)
            else:
                raise _fail("the app kept changing while applying; try again")
            if render.json_mode():
                render.emit_json(result.as_json() | {"dry_run": dry_run})
                return
            print_plan(result, dry_run=dry_run)
            if dry_run:
                return
            if result.pending:
                render.out.print("(or set a pending volume's policy now with `zattera volumes policy`)")
            for name, env_id in result.env_ids.items():
                render.out.print(f"env {spec.project}/{spec.app}/{name} = {env_id}")

    run(go)


@apps_app.command("list")
def apps_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Every environment with its active release and replica counts."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            envs = c.view.envs()
            if render.json_mode():
                render.messages(envs)
                return
            rows = []
            for e in envs:
                release = c.view.release(e.active_release_id)
                rows.append(
                    [
                        env_path(c.view, e),
                        e.meta.id,
                        f"v{release.version}" if release else "-",
                        c.view.env_run_count(e.meta.id),
                        desired_replicas(e),  # what the scheduler converges to: 0 for a cooled env
                    ]
                )
            render.table("environments", ["env", Col("id", wide=True), "active", "running", "desired"], rows)

    run(go)


# ---------------------------------------------------------------------------------------------- deploy


@deploy_app.command("run", cls=_DeployCommand, hidden=True)
def deploy(
    source: Path = typer.Argument(None, metavar="DIR", help="source directory to build and deploy"),
    env: str = typer.Option(..., "--env", help="environment id or project/app/env"),
    image: str = typer.Option("", "--image", help="deploy this image instead of building source"),
    build: str = typer.Option("", "--build", help="deploy the image of a finished build"),
    watch: bool = typer.Option(True, "--watch/--no-watch", help="follow the deployment until it is live"),
) -> None:
    """Deploy: from a source directory (tar, upload, build, deploy), or --image / --build."""
    from cli.source import pack, upload

    if sum(bool(x) for x in (source, image, build)) != 1:
        raise _fail("give exactly one of SOURCE, --image or --build")

    async def go() -> str:
        async with control() as c:
            target = _env_or_fail(c.view, env)
            deployer = Deployer(c.writer, created_by="cli")
            try:
                if source is not None:
                    data = pack(source)
                    digest = await upload(c.conn, data)
                    err.print(f"uploaded source {digest[:19]}… ({len(data):,} bytes)")
                    created = await deployer.deploy_source(target.meta.id, tarball_digest=digest)
                elif image:
                    created = await deployer.deploy_image(target.meta.id, image)
                else:
                    created = await deployer.deploy_build(target.meta.id, build)
            except DeployError as exc:
                raise _refused(exc, {o: v for o, v in (("--image", image), ("--build", build)) if v}) from None
            except ValueError as exc:
                raise _fail(str(exc)) from None
            err.print(
                f"deployment {created.deployment.meta.id} created: release v{created.release.version}"
                f" of {env_path(c.view, target)}"
            )
            return created.deployment.meta.id

    # The root of the deploy's trace: the writes carry its traceparent, and every service that reacts to
    # them (builds, orchestrator, scheduler, agents) continues it.
    with span("cli.deploy", env=env, source=str(source) if source else None, image=image or None) as current:
        deployment_id = run(go)
        current.set_attribute("deployment", deployment_id)
    if watch:
        _watch(deployment_id, until_done=False)
    else:
        print(deployment_id)


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


@deploy_app.command("cancel")
def deploy_cancel(deployment_id: str) -> None:
    """Cancel a deployment: before promotion it fails with the green set removed; while draining the
    old release it finishes the drain now."""

    async def go() -> None:
        async with control() as c:
            try:
                d = await Deployer(c.writer, created_by="cli").cancel(deployment_id)
            except DeployError as exc:
                raise _fail(str(exc)) from None
            err.print(
                f"deployment {d.meta.id}: cancel requested "
                f"({render.enum_name(pb.DeploymentPhase, d.phase, 'DEPLOYMENT_PHASE_')})"
            )

    run(go)


@app.command()
def rollback(
    env: str = typer.Option(..., "--env", help="environment id or project/app/env"),
    to: str = typer.Option("", "--to", help="release id (default: the highest version below the active one)"),
    watch: bool = typer.Option(True, "--watch/--no-watch"),
) -> None:
    """Roll an environment back to an earlier release."""

    async def go() -> str:
        async with control() as c:
            target = _env_or_fail(c.view, env)
            try:
                d = await Deployer(c.writer, created_by="cli").rollback(target.meta.id, to_release_id=to)
            except DeployError as exc:
                raise _refused(exc, {"--to": to} if to else {}) from None
            release = c.view.release(d.release_id)
            err.print(f"rollback {d.meta.id} to v{release.version if release else '?'} created")
            return d.meta.id

    with span("cli.rollback", env=env) as current:
        deployment_id = run(go)
        current.set_attribute("deployment", deployment_id)
    if watch:
        _watch(deployment_id, until_done=False)


@app.command()
def releases(env: str = typer.Option(..., "--env"), json: bool = JSON, wide: bool = WIDE) -> None:
    """The releases of an environment, newest first."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            target = _env_or_fail(c.view, env)
            items = sorted(c.view.releases(target.meta.id), key=lambda r: r.version, reverse=True)
            if render.json_mode():
                render.messages(items)
                return
            render.table(
                f"releases of {env_path(c.view, target)}",
                ["version", "id", "image", "config", "created", "active"],
                [
                    [
                        f"v{r.version}",
                        r.meta.id,
                        r.image_ref or "(building)",
                        f"v{r.service.config_version}",
                        render.ts(r.meta.created_at),
                        "*" if r.meta.id == target.active_release_id else "",
                    ]
                    for r in items
                ],
            )

    run(go)


@deploy_app.command("list")
def deployments(env: str = typer.Option("", "--env"), json: bool = JSON, wide: bool = WIDE) -> None:
    """Deployments (of one environment, or all), newest first."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            target = _env_or_fail(c.view, env) if env else None
            items = list(reversed(c.view.deployments(target.meta.id if target else None)))
            if render.json_mode():
                render.messages(items)
                return
            rows = []
            for d in items:
                release = c.view.release(d.release_id)
                rows.append(
                    [
                        d.meta.id,
                        env_label(c.view, d.environment_id),
                        f"v{release.version}" if release else "?",
                        render.enum_name(pb.DeploymentPhase, d.phase, "DEPLOYMENT_PHASE_"),
                        "rollback" if d.is_rollback else "",
                        d.error,
                    ]
                )
            render.table("deployments", ["id", "env", "release", "phase", "kind", Col("error", wrap=True)], rows)

    run(go)


# ---------------------------------------------------------------------------------------------- inspect


@app.command()
def ps(env: str = typer.Option("", "--env"), json: bool = JSON, wide: bool = WIDE) -> None:
    """Assignments (replicas) with their desired and observed state."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            target = _env_or_fail(c.view, env) if env else None
            items = c.view.assignments(target.meta.id if target else None)
            if render.json_mode():
                render.messages(items)
                return
            rows = []
            for a in items:
                release = c.view.release(a.release_id)
                ports = ",".join(f"{k}:{v}" for k, v in sorted(a.observed.mesh_port_bindings.items()))
                rows.append(
                    [
                        a.meta.id,
                        env_label(c.view, a.environment_id),
                        f"v{release.version}" if release else "?",
                        a.node_id,
                        render.enum_name(pb.AssignmentDesired, a.desired, "ASSIGNMENT_DESIRED_"),
                        render.enum_name(pb.InstanceState, a.observed.state, "INSTANCE_STATE_"),
                        a.observed.restarts,
                        describe_exit(a.observed.last_exit) if a.observed.HasField("last_exit") else "",
                        ports,
                        a.observed.message,
                    ]
                )
            render.table(
                "assignments",
                [
                    Col("id", wide=True),
                    "env",
                    "release",
                    "node",
                    "desired",
                    "observed",
                    "restarts",
                    "last exit",
                    "ports",
                    Col("message", wrap=True),
                ],
                rows,
            )
            envs = [target] if target else c.view.envs()
            print_unplaced(
                [{"env": env_label(c.view, e.meta.id), "placement": placement_status(c.view, e)} for e in envs]
            )

    run(go)


@app.command()
def routes(json: bool = JSON, wide: bool = WIDE) -> None:
    """The current route snapshot, as the proxies see it."""
    _json(json, wide)
    from cli.watch import fetch_routes

    snapshot = run(fetch_routes)
    if snapshot is None:
        raise _fail("no route snapshot yet (is the routes service running?)")
    if render.json_mode():
        render.emit_json(render.as_dict(snapshot))
        return
    projects = run(_project_names)
    rows = []
    for r in snapshot.http_routes:
        endpoints = ", ".join(f"{e.addr}" for e in r.endpoints)
        replicas = ", ".join(f"{e.node_id}/{e.assignment_id}" for e in r.endpoints)
        env_name = f"{projects.get(r.project_id, r.project_id)}/{r.app_name}/{r.environment_name}"
        rows.append([r.hostname, r.path_prefix or "/", env_name, endpoints or "(none)", r.environment_id, replicas])
    render.table(
        f"routes (version {snapshot.version})",
        ["host", "path", "env", "endpoints", Col("env id", wide=True), Col("replicas", wide=True)],
        rows,
    )


async def _project_names() -> dict[str, str]:
    async with control() as c:
        return {p.meta.id: p.name for p in c.view.all(K.PROJECT) if isinstance(p, pb.Project)}


# ---------------------------------------------------------------------------------------------- builds


@builds_app.command("list")
def builds_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Builds, newest first."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            items = list(reversed(c.view.builds()))
            if render.json_mode():
                render.messages(items)
                return
            render.table(
                "builds",
                ["id", "env", "status", "node", "image", Col("error", wrap=True)],
                [
                    [
                        b.meta.id,
                        env_label(c.view, b.environment_id),
                        render.enum_name(pb.BuildStatus, b.status, "BUILD_STATUS_"),
                        b.node_id,
                        b.image_ref,
                        b.error,
                    ]
                    for b in items
                ],
            )

    run(go)


@builds_app.command("logs")
def builds_logs(build_id: str, follow: bool = typer.Option(False, "--follow", "-f"), json: bool = JSON) -> None:
    """A build's log; --follow streams it until the build ends; --json prints one object per line."""
    from nats.js.errors import NotFoundError

    from shared.buildlogs import follow_build_log, read_build_log
    from shared.ids import is_safe_id, unsafe_id
    from shared.natsio import STATE_PREFIX, STATE_STREAM

    if not is_safe_id(build_id):
        raise _fail(f"{unsafe_id('build id', build_id)} (see `zattera builds list`)")

    async def recorded(c: Control) -> bool:
        try:
            msg = await c.conn.js.get_last_msg(STATE_STREAM, STATE_PREFIX + K.build(build_id))
        except NotFoundError:
            return False
        return bool(msg.data)  # a deleted record leaves an empty marker

    async def go() -> None:
        async with control(view=False) as c:
            # No record and no stored line: an unknown id (a follow would wait for it forever).
            if not await recorded(c) and (follow or not await read_build_log(c.conn, build_id)):
                raise _fail(f"build {build_id!r} not found (see `zattera builds list`)")
            if follow:
                async for line in follow_build_log(c.conn, build_id):
                    print(build_log_line(build_id, line, json), flush=True)
            else:
                for line in await read_build_log(c.conn, build_id):
                    print(build_log_line(build_id, line, json))

    run(go)


def build_log_line(build_id: str, line: str, as_json: bool) -> str:
    import json as json_lib

    return json_lib.dumps({"build_id": build_id, "line": line}) if as_json else line


@builds_app.command("cancel")
def builds_cancel(build_id: str) -> None:
    """Cancel a QUEUED or RUNNING build (its builder is told to stop)."""
    from shared.buildcancel import CancelRefused, cancel_build
    from shared.clock import RealClock

    async def go() -> None:
        async with control() as c:
            try:
                await cancel_build(c.writer, build_id, clock=RealClock())
            except CancelRefused as exc:
                raise _fail(str(exc)) from None
            err.print(f"build {build_id}: canceled")

    run(go)


# ---------------------------------------------------------------------------------------------- volumes


@volumes_app.command("list")
def volumes_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Volumes, their pinned node and their snapshots."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            items = c.view.volumes()
            if render.json_mode():
                render.messages(items)
                return
            snaps = c.view.snapshots()
            rows = []
            for v in items:
                mine = [s for s in snaps if s.volume_id == v.meta.id]
                rows.append(
                    [
                        v.meta.id,
                        v.name,
                        env_label(c.view, v.environment_id),
                        v.node_id,
                        render.enum_name(pb.VolumeStatus, v.status, "VOLUME_STATUS_"),
                        v.snapshot_policy.schedule or "-",
                        len(mine),
                    ]
                )
            render.table("volumes", ["id", "name", "env", "node", "status", "schedule", "snapshots"], rows)

    run(go)


@volumes_app.command("policy")
def volumes_policy(
    volume_id: str = typer.Argument(..., help="volume id (see `zattera volumes list`)"),
    schedule: str | None = typer.Option(
        None, "--schedule", help='cron, 5 fields in UTC (CRON_TZ=Zone prefix, @daily, @every 6h); "" = manual only'
    ),
    keep_last: int | None = typer.Option(None, "--keep-last", min=0, max=1000, help="COMPLETE snapshots kept; 0 = 7"),
    pre_hook: str | None = typer.Option(
        None, "--pre-hook", help='shell command run in the instance before each snapshot; "" = none'
    ),
    json: bool = JSON,
) -> None:
    """Set a volume's snapshot policy (only the options given change; `apps apply` uses the same code)."""
    from cli.apply import with_policy
    from cli.spec import PolicyChange, validate_schedule

    _json(json)
    if schedule is not None:
        try:
            schedule = validate_schedule(schedule)
        except ValueError as exc:
            raise _fail(f"--schedule: {exc}") from None
    change = PolicyChange(schedule=schedule, keep_last=keep_last, pre_hook=pre_hook)
    if not change:
        raise _fail("give at least one of --schedule, --keep-last or --pre-hook")

    async def go() -> None:
        async with control() as c:

            def edit() -> pb.Volume | None:
                volume = c.view.volume(volume_id)
                if volume is None:
                    raise _fail(f"volume {volume_id!r} not found")
                return with_policy(volume, change, time.time())

            await _commit_edit(c, f"volume {volume_id}", edit)
            volume = c.view.volume(volume_id)
            assert volume is not None
            policy = volume.snapshot_policy
            if render.json_mode():
                render.emit_json(render.as_dict(policy))
                return
            err.print(
                f"volume {volume.name} ({volume_id}): schedule {policy.schedule or '(manual only)'}, "
                f"keep last {policy.keep_last or 7}, pre-hook {policy.pre_hook or '(none)'}",
                markup=False,
                highlight=False,
            )

    run(go)


@volumes_app.command("snapshots")
def volumes_snapshots(
    volume_id: str = typer.Argument(..., help="volume id (see `zattera volumes list`)"),
    json: bool = JSON,
    wide: bool = WIDE,
) -> None:
    """A volume's snapshot records, newest first: the ids `zattera volumes restore` takes."""
    _json(json, wide)

    async def go() -> None:
        async with control() as c:
            volume = c.view.volume(volume_id)
            records = [s for s in c.view.snapshots() if s.volume_id == volume_id]
            if volume is None and not records:
                raise _fail(f"volume {volume_id!r} not found")
            records.sort(key=lambda s: (s.meta.created_at.ToNanoseconds(), s.meta.id), reverse=True)
            if render.json_mode():
                render.messages(records)
                return
            render.table(
                f"snapshots of volume {volume.name if volume else '(deleted)'} ({volume_id})",
                ["id", "state", "created", "size", "uploaded", Col("error", wrap=True)],
                [
                    [
                        s.meta.id,
                        render.enum_name(pb.SnapshotStatus, s.status, "SNAPSHOT_STATUS_"),
                        render.ts(s.meta.created_at),
                        f"{s.logical_size_bytes:,} B",
                        f"{s.uploaded_bytes:,} B",
                        s.error,
                    ]
                    for s in records
                ],
            )

    run(go)


def _snapshot_dispatcher(c: Control) -> Any:
    from shared.clock import RealClock
    from shared.snapshots.dispatch import operator_dispatcher

    return operator_dispatcher(c.conn, c.view, RealClock(), settings().restore_timeout)


@volumes_app.command("snapshot")
def volumes_snapshot(volume_id: str) -> None:
    """Snapshot a volume now (on its node), and wait for the result."""

    async def go() -> None:
        async with control() as c:
            volume = c.view.volume(volume_id)
            if volume is None:
                raise _fail(f"volume {volume_id!r} not found")
            err.print(f"snapshotting volume {volume.name} on node {volume.node_id} …")
            try:
                record = await _snapshot_dispatcher(c).snapshot(volume, c.writer)
            except Exception as exc:
                raise _fail(f"snapshot failed: {exc}") from None
            status = render.enum_name(pb.SnapshotStatus, record.status, "SNAPSHOT_STATUS_")
            err.print(
                f"snapshot {record.meta.id}: {status}, {record.logical_size_bytes:,} bytes, "
                f"{record.uploaded_bytes:,} uploaded {record.error}"
            )
            if record.status != pb.SNAPSHOT_STATUS_COMPLETE:
                raise typer.Exit(1)

    run(go)


@volumes_app.command("restore")
def volumes_restore(volume_id: str, snapshot_id: str) -> None:
    """Rebuild a volume from a COMPLETE snapshot (ids: `volumes snapshots VOL`); not while mounted or restoring."""

    async def go() -> None:
        async with control() as c:
            try:
                await _snapshot_dispatcher(c).restore(volume_id, snapshot_id, c.writer)
            except Exception as exc:
                raise _fail(f"restore refused or failed: {exc}") from None
            err.print(f"volume {volume_id} restored from snapshot {snapshot_id}")

    run(go)


# Issue 21: operating environments (cli/env_cmds.py).
app.command("status")(status)
app.command("scale")(scale)
apps_app.command("delete")(apps_delete)
app.add_typer(envs_app, name="envs")
app.add_typer(projects_app, name="projects")


def main() -> None:
    app()


__all__ = ["K", "app", "is_terminal", "main"]
