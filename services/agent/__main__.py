"""Entry point: ``python -m services.agent --nats URL --node-id ID --data-dir DIR [--labels k=v,...]
[--builder] [--roles worker,control] [--mesh-ip IP] [--runtime process|docker] [--stop-on-exit]
[--join-token TOKEN]``.

Every flag has a ``ZATTERA_AGENT_*`` setting (``services/agent/settings.py``); the NATS URL and the data
dir default to ``ZATTERA_NATS_URL`` and ``ZATTERA_DATA_DIR`` (``<data>/agent-<node id>`` then).
SIGTERM/SIGINT stop the agent; its instances keep running for the next run to adopt unless
``--stop-on-exit``.

On a secured cluster the agent connects with its node credential (``credentials.py``: stored by a first
start with ``--join-token``, or ``ZATTERA_NATS_CREDS``) and verifies the server with
``ZATTERA_NATS_TLS_CA``. An authenticated agent does not provision streams (its credential may not): it
waits until the services have. A refused join token exits with status 2 and the join service's reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from services.agent.agent import Agent
from services.agent.credentials import CredentialError, node_credentials
from services.agent.registration import default_node_id
from services.agent.settings import AgentSettings
from shared.backoff import retry_until_done
from shared.metrics import add_metrics_argument, metrics_port, serve_metrics
from shared.natsio import STATE_STREAM, Connection, connect_until_stopped, provision, provision_options
from shared.security.join import JoinRefused
from shared.service import configure_logging
from shared.settings import settings as shared_settings
from shared.telemetry import setup as setup_telemetry

log = logging.getLogger(__name__)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.agent", description="Zattera node agent")
    parser.add_argument("--nats", default=None, help="NATS URL(s), comma-separated (default: $ZATTERA_NATS_URL)")
    parser.add_argument("--node-id", default=None, help="node id (default: $ZATTERA_AGENT_NODE_ID or the host name)")
    parser.add_argument("--data-dir", type=Path, default=None, help="instances, volumes and builds live here")
    parser.add_argument("--labels", default=None, help="operator labels, k=v,k2=v2")
    parser.add_argument("--builder", action="store_true", default=None, help="serve source builds")
    parser.add_argument("--roles", default=None, help="worker and/or control, comma-separated (default: worker)")
    parser.add_argument("--mesh-ip", default=None, help="address other nodes reach this node's instances at")
    parser.add_argument(
        "--runtime", default=None, help="process or docker (default: docker when a Docker daemon answers)"
    )
    parser.add_argument("--stop-on-exit", action="store_true", default=None, help="stop instances on exit")
    parser.add_argument(
        "--join-token", default=None, help="join a secured cluster (once; see SECURITY.md), $ZATTERA_AGENT_JOIN_TOKEN"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_metrics_argument(parser)
    return parser.parse_args(argv)


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    """Environment settings overridden by the flags that were given."""
    overrides: dict[str, object] = {}
    if args.node_id is not None:
        overrides["node_id"] = args.node_id
    if args.labels is not None:
        overrides["labels"] = args.labels
    if args.builder is not None:
        overrides["builder"] = args.builder
    if args.roles is not None:
        overrides["roles"] = args.roles
    if args.mesh_ip is not None:
        overrides["mesh_ip"] = args.mesh_ip
    if args.runtime is not None:
        overrides["runtime"] = args.runtime
    if args.stop_on_exit is not None:
        overrides["stop_on_exit"] = args.stop_on_exit
    if args.join_token is not None:
        overrides["join_token"] = args.join_token
    cfg = AgentSettings(**overrides)  # type: ignore[arg-type]
    return cfg if cfg.node_id else cfg.model_copy(update={"node_id": default_node_id()})


def agent_data_dir(given: Path | None, shared_data_dir: Path, node_id: str) -> Path:
    return (given or shared_data_dir / f"agent-{node_id}").resolve()


async def wait_provisioned(conn: Connection, stop: asyncio.Event) -> bool:
    """Until the state stream exists (the services provision a secured cluster); False once stopped."""

    return await retry_until_done(
        lambda: conn.js.stream_info(STATE_STREAM),
        stop,
        what=f"waiting for the control plane to provision {STATE_STREAM}",
        retry_on=(NotFoundError, NatsError, TimeoutError),
        level=logging.INFO,
    )


async def serve(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    setup_telemetry("zattera-agent")
    try:
        cfg = agent_settings(args)
    except (ValidationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shared = shared_settings()
    serve_metrics("zattera-agent", metrics_port(args.metrics_port, shared.metrics_port), shared.metrics_host)
    data_dir = agent_data_dir(args.data_dir, shared.data_dir, cfg.node_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    urls = args.nats or shared.nats_url
    tls_ca = shared.nats_tls_ca or None
    try:
        creds = await node_credentials(
            urls,
            cfg.node_id,
            data_dir,
            join_token=cfg.join_token,
            env_creds=shared.nats_creds,
            tls_ca=shared.nats_tls_ca,
            stop=stop,
        )
    except (JoinRefused, CredentialError) as exc:
        log.error("agent %s: no NATS credential: %s", cfg.node_id, exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    conn = await connect_until_stopped(urls, f"zattera-agent-{cfg.node_id}", stop, creds=creds, tls_ca=tls_ca)
    if conn is None:
        return 0
    try:
        if creds:
            if not await wait_provisioned(conn, stop):
                return 0
        else:
            await provision(conn.js, **provision_options(shared))
        agent_task = asyncio.create_task(Agent(conn, cfg, data_dir, secured=bool(creds)).run())
        stopper = asyncio.create_task(stop.wait())
        lost = asyncio.create_task(conn.lost.wait())
        await asyncio.wait({agent_task, stopper, lost}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        lost.cancel()
        if agent_task.done() and agent_task.exception() is not None:
            log.error("agent failed: %r", agent_task.exception())
            return 1
        if conn.lost.is_set():
            log.error("agent %s: lost its NATS connection for good; exiting so that it is restarted", cfg.node_id)
            agent_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await agent_task
            return 1
        agent_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await agent_task
    finally:
        await conn.close()
    log.info("agent %s: stopped", cfg.node_id)
    return 0


def main() -> None:
    sys.exit(asyncio.run(serve()))


if __name__ == "__main__":
    main()
