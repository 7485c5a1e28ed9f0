"""Security commands: ``zattera up --secure/--tls``, ``zattera nodes join-token`` (registered on the nodes
group by cli/nodes_cmds.py), ``zattera security creds|revoke``."""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import typer

from cli.client import connect_cli, run
from cli.layout import NODE_CREDS, PROXY_CREDS, DataLayout
from cli.supervised import Supervised
from cli.up import run_up
from cli.up_cluster import LOCAL_NODE, Cluster
from shared.embedded import SERVER_DIR
from shared.security.authority import Authority
from shared.security.join import DEFAULT_TTL, JoinRefused, new_secret
from shared.security.join_client import request_join_token
from shared.security.machines import seal_bundle
from shared.security.permissions import Role
from shared.security.setup import prepare
from shared.settings import settings
from shared.subjects import STATE_STREAM

security_app = typer.Typer(no_args_is_help=True, help="Credentials of a secured cluster (see SECURITY.md).")

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` → seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise typer.BadParameter(f"{text!r}: expected a duration like 30m, 2h or 1d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


OPEN_ACCOUNT = "$G"
"""The account nats-server puts every client in without operator mode: where an open cluster's streams live."""
_SYSTEM_ACCOUNT = "$SYS"


def cluster_accounts(layout: DataLayout) -> set[str]:
    """The NATS accounts of the embedded server's store that hold a Zattera cluster's state (``$G``: an open
    one; an account key: a secured one), read from the JetStream store on disk."""
    store = layout.control / "nats" / "jetstream" / "jetstream"  # nats-server keeps accounts in <store_dir>/jetstream
    if not store.is_dir():
        return set()
    found = {path.parent.parent.name for path in store.glob(f"*/streams/{STATE_STREAM}")}
    return found - {_SYSTEM_ACCOUNT}


def mode_switch_problem(layout: DataLayout, *, secure: bool) -> str | None:
    """Why ``zattera up`` (``secure``: with --secure/--tls) must not start on this data dir: it holds a cluster
    of the other mode and none of this one, so NATS would start a second, empty cluster beside it (another
    account, another state stream) while the apps, the proxy's cached routes and the agent's instances
    belong to the first. None when the data dir is new or already holds a cluster of this mode."""
    data_dir = layout.root
    accounts = cluster_accounts(layout)
    has_open = OPEN_ACCOUNT in accounts
    has_secure = bool(accounts - {OPEN_ACCOUNT}) or (layout.security / "accounts.json").exists()
    if secure and has_open and not has_secure:
        return (
            f"{data_dir} holds an open cluster (its state is in NATS's global account): started --secure, "
            "NATS would put the services in accounts of their own and start a second, empty cluster beside it, "
            "without the open one's apps and routes. Start it as it is (`zattera up`), or start a secure cluster "
            f"in a new data dir (`zattera up --secure --data-dir DIR`, then apply and deploy the apps there), or "
            f"move the open cluster aside first (`mv {data_dir} {data_dir}.open`). SECURITY.md, "
            '"Switching a data dir to --secure".'
        )
    if not secure and has_secure and not has_open:
        return (
            f"{data_dir} holds a secured cluster (control/security/ and its accounts): start it with "
            "`zattera up --secure` (`--tls` if it was started with TLS). Without it NATS would start without "
            "accounts and a second, empty cluster beside the secured one. SECURITY.md, "
            '"Switching a data dir to --secure".'
        )
    return None


def secure_up(plain: Cluster, *, tls: bool) -> int:
    """``zattera up`` of ``plain`` (the cluster as asked) with operator-mode auth (and TLS): every service
    runs with the control credential, the local agent with a builder credential and the local proxy with a
    proxy credential of its own, each kept in its own directory (``cli/layout.py``), not among the control
    plane's files. With ``nats_cluster`` > 1 every server of the cluster gets the same accounts and TLS, and
    their routes are authenticated (and TLS, verified both ways, with ``tls``)."""
    layout = DataLayout(plain.data_dir)
    setup = prepare(layout.security, tls=tls)
    ca = str(setup.tls_ca or "")
    join = Supervised("join", [sys.executable, "-m", "services.join"], layout.logs / "join.log", {})
    node_creds = {
        "agent": str(setup.issue(Role.BUILDER, LOCAL_NODE, layout.agent / NODE_CREDS)),
        "proxy": str(setup.issue(Role.PROXY, LOCAL_NODE, layout.proxy / PROXY_CREDS)),
    }
    cluster = replace(
        plain,
        extra=[*plain.extra, join],
        nats_extra_config=setup.server_config(resolver_dir=f"{SERVER_DIR}/jwt"),
        nats_routes=asdict(setup.route_security()) if plain.nats_cluster > 1 else {},
        creds=str(setup.control_creds),
        tls_ca=ca,
        node_creds=node_creds,
    )
    hint = f"  CLI:       export ZATTERA_NATS_CREDS={setup.operator_creds}"
    if ca:
        hint += f" ZATTERA_NATS_TLS_CA={ca}"
    hint += "\n  Add nodes: zattera nodes join-token  (then start the agent with --join-token)"
    return run_up(cluster, hint=hint)


def join_token(
    ttl: str = typer.Option("1h", help="how long the token stays valid (e.g. 30m, 2h, 1d; at most 7d)"),
    node: str = typer.Option("", help="bind the token to this node id (required to re-join an existing node)"),
    builder: bool = typer.Option(False, help="the node may also run builds and push images"),
    server: bool = typer.Option(
        False, "--server", help="for a server machine (zattera up --join T --server); run on a server machine"
    ),
    data_dir: Path = typer.Option(None, help="with --server: holds control/security/ (default: $ZATTERA_DATA_DIR)"),
) -> None:
    """Print a single-use, expiring token: for `zattera up --join TOKEN [--server]` (it names the cluster's
    servers and CA) or an agent's --join-token."""
    seconds = parse_duration(ttl) if ttl else DEFAULT_TTL
    secret = bundle = ""
    if server:
        directory = security_directory(data_dir)
        if not (directory / "accounts.json").exists():
            typer.echo(f"error: --server: no security setup in {directory} (run it on a server machine)", err=True)
            raise typer.Exit(1)
        secret = new_secret()
        bundle = seal_bundle(secret, directory)

    async def issue() -> str:
        conn = await connect_cli()
        try:
            return await request_join_token(
                conn, ttl=seconds, node_id=node, builder=builder, server_secret=secret, server_bundle=bundle
            )
        finally:
            await conn.close()

    try:
        typer.echo(run(issue))
    except JoinRefused as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def security_directory(data_dir: Path | None) -> Path:
    """``<data dir>/control/security`` (``cli/layout.py``), or ``<data dir>/security`` of a data dir no
    ``zattera up`` has moved to that layout yet."""
    layout = DataLayout((data_dir or settings().data_dir).resolve())
    old = layout.root / "security"
    return old if not layout.security.exists() and old.exists() else layout.security


@security_app.command("creds")
def issue_creds(
    role: Role = typer.Argument(..., help="control, operator, agent, builder or proxy"),
    name: str = typer.Argument(..., help="the node id of an agent, the proxy id of a proxy, any label otherwise"),
    data_dir: Path = typer.Option(None, help="holds control/security/ (default: $ZATTERA_DATA_DIR)"),
) -> None:
    """Issue a credentials file signed by the role's scoped key; prints its path."""
    directory = security_directory(data_dir)
    if not (directory / "accounts.json").exists():
        typer.echo(f"error: no security setup in {directory} (run zattera up --secure first)", err=True)
        raise typer.Exit(1)
    typer.echo(str(prepare(directory, tls=(directory / "tls").exists()).creds(role, name)))


@security_app.command("revoke")
def revoke(
    user_public_key: str = typer.Argument(..., help="the U… key of the credential (its JWT 'sub')"),
    data_dir: Path = typer.Option(None, help="holds control/security/ (default: $ZATTERA_DATA_DIR)"),
) -> None:
    """Revoke a user credential: rewrites the account JWT; restart (or reload) nats-server to apply."""
    directory = security_directory(data_dir)
    authority = Authority.load(directory)
    authority.revoke(user_public_key)
    authority.save(directory)
    typer.echo(f"revoked {user_public_key}; apply with: nats-server --signal reload (or restart zattera up)")
