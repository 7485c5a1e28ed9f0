"""Commands for a cluster of machines (docs/cluster.md, "From one machine to three"): ``zattera up --name N
--advertise IP`` and ``zattera up --join TOKEN [--server]`` (cli/machine.py), ``zattera nodes remove``,
``zattera cluster replicas N``. Each command parses and renders; the work is in cli/machine.py and the join
service (shared/security/machine_service.py)."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from cli.client import fail, on_cluster
from cli.machine import Machine, MachineError, bootstrap, join, machine_cluster
from cli.up import run_up
from shared.actions.nodes import (
    NodeRemoved,
    RemoveNode,
    RetireSeats,
    SeatsRetired,
    remove_node,
    retire_seats,
)

NODE_NAME = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,62}[a-z0-9])?$")


def machine_up(
    data_dir: object,
    token: str,
    *,
    server: bool,
    name: str,
    advertise: str,
    tls: bool,
    options: dict[str, Any] | None = None,
) -> int:
    """``zattera up --join`` / ``--name --advertise``, or ``zattera up`` on a data dir that holds a machine
    (``machine.json``: it resumes, whatever it joined as): one line on stderr and exit 1 for any bad input.
    ``options``: the :class:`~cli.up_cluster.Cluster` settings of ``zattera up``'s other flags (the proxy's
    listeners, the metrics port)."""
    directory = Path(str(data_dir))
    recorded = Machine.load(directory)
    if recorded is not None and not token and not name and not advertise:  # a machine started again
        return _run_machine(directory, recorded, options)
    if not NODE_NAME.match(name):
        raise fail("--name: this machine's node id is required (lowercase letters, digits, '-', '_')")
    try:
        ipaddress.ip_address(advertise)
    except ValueError:
        raise fail(f"--advertise: {advertise!r} is not an IP address other machines can reach") from None
    try:
        if token:
            machine = join(directory, token, name, advertise, server=server)
        else:
            if server:
                raise MachineError("--server needs --join TOKEN (the first machine is a server already)")
            machine = bootstrap(directory, name, advertise, tls=tls)
    except MachineError as exc:
        raise fail(str(exc)) from None
    return _run_machine(directory, machine, options)


def _run_machine(directory: Path, machine: Machine, options: dict[str, Any] | None) -> int:
    try:
        cluster = machine_cluster(directory, machine, **(options or {}))
    except MachineError as exc:
        raise fail(str(exc)) from None
    hint = f"  machine {machine.node_id}: {machine.role}, mesh {machine.mesh_ip or '-'}, servers {cluster.url or '-'}"
    return run_up(cluster, hint=hint)


def nodes_remove(
    node_id: str,
    force: bool = typer.Option(
        False, "--force", help="remove a server machine even when the machines left cannot hold every stream's copies"
    ),
    json_output: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Remove a machine: drain its node (its replicas move off), revoke every credential it was issued or made,
    peer-remove its NATS servers (their stream copies go to the other server machines) and delete its node
    record. A server machine whose removal would leave streams with fewer machines than copies is refused
    unless --force."""

    done = on_cluster(remove_node, RemoveNode(node_id, force=force), follow=True, what=f"nodes remove {node_id}")
    _report(
        done,
        json_output,
        f"removed {node_id}: {'drained, ' if done.drained else ''}{len(done.revoked)} credential(s) revoked"
        + (f", NATS server(s) {', '.join(done.servers)} peer-removed" if done.servers else ""),
    )


def _report(done: NodeRemoved | SeatsRetired, json_output: bool, line: str) -> None:
    """The result as JSON, or ``line`` and a warning per stream left short of its copies."""
    if json_output:
        typer.echo(json.dumps(asdict(done)))
        return
    typer.echo(line)
    for stream in done.short:
        typer.echo(
            f"warning: {stream.stream}: {stream.current} of {stream.replicas} copies caught up "
            f"(on {', '.join(stream.servers) or 'no server'}): the server machines left cannot hold "
            f"{stream.replicas}; join another server machine, or zattera cluster replicas 1",
            err=True,
        )


def cluster_retire_seats(json_output: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Retire the first machine's two extra JetStream seats, once three server machines hold every stream at
    three copies (zattera cluster replicas 3): they are peer-removed, and the first machine's zattera up stops
    them and does not start them again. Then losing the first machine costs one server of three, not three of
    five."""

    done = on_cluster(retire_seats, RetireSeats(), view=False, what="cluster retire-seats")
    _report(
        done,
        json_output,
        f"retired the extra seats of {done.node_id}: {', '.join(done.retired)} peer-removed and stopped",
    )
