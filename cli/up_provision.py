"""Provisioning for ``zattera up``: create what is missing and run the migrations, in a short-lived child
interpreter so that nats-py and asyncio never stay resident in the supervisor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cli.supervised import PROJECT_ROOT

if TYPE_CHECKING:
    from cli.up_cluster import Cluster


REFUSED_EXIT = 2
"""The provisioning child's status when this version may not run on the cluster (it said why on stderr)."""


async def _provision(url: str, creds: str = "", tls_ca: str = "", replicas: int = 1) -> int:
    """Create what is missing, then bring the cluster to this code's schema, saying on stderr which
    migrations ran (docs/upgrades.md); :data:`REFUSED_EXIT` when this version may not run on it."""
    import asyncio

    from shared.connection import connect
    from shared.events import EventPublisher
    from shared.lease import default_holder
    from shared.migrations.runner import MigrationFailed, upgrade
    from shared.provisioning import provision
    from shared.skew import SkewRefused

    conn = await connect(url, name="zattera-up", creds=creds or None, tls_ca=tls_ca or None)
    try:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                await asyncio.wait_for(provision(conn.js, replicas=replicas), 5.0)
                break
            except Exception:
                # a fresh cluster elects its JetStream meta leader first (the first machine's three seats too,
                # whose streams have one copy); a single server answers at once
                if ("," not in url and replicas == 1) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        try:
            await upgrade(
                conn,
                holder=default_holder("zattera-up"),
                progress=lambda line: print(line, file=sys.stderr, flush=True),
                events=EventPublisher(conn),
            )
        except (SkewRefused, MigrationFailed) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return REFUSED_EXIT
        return 0
    finally:
        await conn.close()


PROVISION_ENV = "ZATTERA_UP_PROVISION"
"""How :func:`provision_in_child` hands what to provision (URL, credentials file, CA file, replicas) to it."""


def provision_in_child(cluster: Cluster, echo: Callable[[str], None] | None = None) -> None:
    """Provision ``cluster`` from a short-lived interpreter (``python -m cli.up`` with :data:`PROVISION_ENV`):
    nats-py and asyncio, loaded here once, would stay resident in the supervisor for as long as the cluster
    runs (~15 MB of a single machine's control plane, PERFORMANCE.md "footprint"). Nothing where no control
    plane runs (a worker machine, which may not create or migrate streams). Its error, if any, is on
    stderr (given to ``echo`` line by line, when given); SystemExit here then stops the cluster."""
    if not cluster.control_plane():
        return  # a worker machine: the servers' control plane provisions and migrates (it holds no credential to)
    given = {"url": cluster.url, "creds": cluster.creds, "tls_ca": cluster.tls_ca, "replicas": cluster.replicas}
    env = {**os.environ, PROVISION_ENV: json.dumps(given)}
    done = subprocess.run(
        [sys.executable, "-m", "cli.up"],
        env=env,
        cwd=PROJECT_ROOT,
        check=False,
        stderr=subprocess.PIPE if echo else None,
        text=True,
    )
    if echo is not None:
        for line in (done.stderr or "").splitlines():
            echo(line)
    if done.returncode == REFUSED_EXIT:
        raise SystemExit(REFUSED_EXIT)  # the child said why, in one line
    if done.returncode != 0:
        raise SystemExit(f"provisioning the streams and buckets at {cluster.url} failed (exit {done.returncode})")
