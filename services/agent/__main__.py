"""Entry point: ``python -m services.agent --nats URL --node-id ID --data-dir DIR [--labels k=v,...]
[--builder] [--roles worker,control] [--mesh-ip IP] [--runtime process|docker] [--stop-on-exit]
[--join-token TOKEN]``.

Every flag has a ``ZATTERA_AGENT_*`` setting (``services/agent/settings.py``); the NATS URL and the data
dir default to ``ZATTERA_NATS_URL`` and ``ZATTERA_DATA_DIR`` (``<data>/agent-<node id>`` then).
SIGTERM/SIGINT stop the agent; its instances keep running for the next run to adopt unless
``--stop-on-exit`` (SIGUSR2, a stop to be restarted at once, keeps them whatever it says).

Apps run sandboxed when the machine can (``sandbox.py``; ``ZATTERA_AGENT_SANDBOX``); a secured agent on a
machine that cannot isolate them exits with status 2 and the reason, unless ``--allow-unisolated-apps``.

On a secured cluster the agent connects with its node credential (``credentials.py``: stored by a first
start with ``--join-token``, or ``ZATTERA_NATS_CREDS``) and verifies the server with
``ZATTERA_NATS_TLS_CA``. An authenticated agent does not provision streams (its credential may not): it
waits until the services have. A refused join token exits with status 2 and the join service's reason.
An agent too old for the cluster exits with status 2 saying so; one newer than the cluster's schema waits
for the control plane's upgrade (docs/upgrades.md, version skew).
"""

from __future__ import annotations

from shared.lean import import_nats, settle_soon

import_nats()  # before anything loads nats-py: without aiohttp (PERFORMANCE.md "A lighter node")

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from services.agent.agent import Agent, node_runtime
from services.agent.credentials import CredentialError, node_credentials
from services.agent.registration import default_node_id
from services.agent.sandbox import IsolationRefused
from services.agent.settings import AgentSettings
from shared.process import Process, run_process
from shared.provisioning import provision, provision_options
from shared.security.join import JoinRefused
from shared.skew import Component, SkewRefused
from shared.subjects import STATE_STREAM
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def agent_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-id", default=None, help="node id (default: $ZATTERA_AGENT_NODE_ID or the host name)")
    parser.add_argument("--data-dir", type=Path, default=None, help="instances, volumes and builds live here")
    parser.add_argument("--labels", default=None, help="operator labels, k=v,k2=v2")
    parser.add_argument("--builder", action="store_true", default=None, help="serve source builds")
    parser.add_argument("--roles", default=None, help="worker and/or control, comma-separated (default: worker)")
    parser.add_argument("--mesh-ip", default=None, help="address other nodes reach this node's instances at")
    parser.add_argument(
        "--public-endpoint", default=None, help="this machine's address for the WireGuard mesh (with --mesh-ip)"
    )
    parser.add_argument(
        "--runtime", default=None, help="process or docker (default: docker when a Docker daemon answers)"
    )
    parser.add_argument("--stop-on-exit", action="store_true", default=None, help="stop instances on exit")
    parser.add_argument(
        "--join-token", default=None, help="join a secured cluster (once; see SECURITY.md), $ZATTERA_AGENT_JOIN_TOKEN"
    )
    parser.add_argument(
        "--allow-unisolated-apps",
        action="store_true",
        default=None,
        help="on a secured cluster, run apps even where this machine cannot isolate them (SECURITY.md)",
    )


FLAG_SETTINGS = {
    "node_id": "node_id",
    "labels": "labels",
    "builder": "builder",
    "roles": "roles",
    "mesh_ip": "mesh_ip",
    "public_endpoint": "public_endpoint",
    "runtime": "runtime",
    "stop_on_exit": "stop_on_exit",
    "join_token": "join_token",
    "allow_unisolated_apps": "allow_unisolated",
}
"""The flag (its ``argparse`` name) that overrides each agent setting."""


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    """Environment settings overridden by the flags that were given."""
    overrides = {
        setting: value for flag, setting in FLAG_SETTINGS.items() if (value := getattr(args, flag)) is not None
    }
    cfg = AgentSettings(**overrides)
    return cfg if cfg.node_id else cfg.model_copy(update={"node_id": default_node_id()})


def agent_data_dir(given: Path | None, shared_data_dir: Path, node_id: str) -> Path:
    return (given or shared_data_dir / f"agent-{node_id}").resolve()


async def run_agent(process: Process) -> int:
    try:
        cfg = agent_settings(process.args)
    except (ValidationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shared = process.settings
    data_dir = agent_data_dir(process.args.data_dir, shared.data_dir, cfg.node_id)
    try:
        creds = await node_credentials(
            process.nats_url,
            cfg.node_id,
            data_dir,
            join_token=cfg.join_token,
            env_creds=shared.nats_creds,
            tls_ca=shared.nats_tls_ca,
            stop=process.stop,
        )
    except (JoinRefused, CredentialError) as exc:
        log.error("agent %s: no NATS credential: %s", cfg.node_id, exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        runtime = await node_runtime(cfg, data_dir, secured=bool(creds))
    except IsolationRefused as exc:
        log.error("agent %s: %s", cfg.node_id, exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    conn = await process.connect(f"zattera-agent-{cfg.node_id}", creds=creds)
    if conn is None:
        await runtime.launcher.close()
        return 0
    tasks: list[asyncio.Task[None]] = []
    agents: list[Agent] = []

    async def shutdown() -> None:
        if process.restarting:  # restarted at once (an upgrade): its instances stay for it to adopt
            cfg.stop_on_exit = False
            for agent in agents:
                agent.handover = True
        await cancel_and_wait(*tasks)
        await conn.close()

    try:
        if creds:
            # An authenticated agent does not provision (its credential may not): it waits for the services.
            ready = await process.retry(
                lambda: conn.js.stream_info(STATE_STREAM),
                what=f"waiting for the control plane to provision {STATE_STREAM}",
                retry_on=(NotFoundError, NatsError, TimeoutError),
                level=logging.INFO,
            )
            if ready is None:
                return 0
        else:
            await provision(conn.js, **provision_options(shared))
        try:
            if not await process.await_compatible(conn, Component.AGENT):
                return 0
        except SkewRefused as exc:
            log.error("agent %s: %s", cfg.node_id, exc)
            print(f"error: {exc}", file=sys.stderr)
            return 2
        agents.append(Agent(conn, cfg, data_dir, secured=bool(creds), runtime=runtime))
        tasks.append(asyncio.create_task(agents[0].run()))
        settle_soon()
        return await process.supervise(tasks, conn)
    finally:
        # No grace: stopping instances (--stop-on-exit) and the final report take what they take.
        await process.shut_down(shutdown, grace=None)


async def serve(argv: Sequence[str] | None = None) -> int:
    return await run_process(
        "agent",
        run_agent,
        argv,
        prog="python -m services.agent",
        description="Zattera node agent",
        arguments=agent_arguments,
    )


def main() -> None:
    sys.exit(asyncio.run(serve()))


if __name__ == "__main__":
    main()
