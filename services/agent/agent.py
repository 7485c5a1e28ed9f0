"""The node agent: registration, the process runtime, heartbeats, and (when asked) builds and volume snapshots.

``Agent.run`` loads a state view of the keys it needs (:func:`view_filters`: its own assignments, observed
reports and node record, every release and volume; exactly what an agent credential may read, SECURITY.md),
registers ``node.<id>``, then runs until cancelled:

* the observed-state reporter and the runtime (``runtime.py``; processes or containers: ``launchers.py``,
  ``docker_runtime.py``, chosen at start by ``docker_runtime.choose_launcher``), which converge this node's
  assignments and write only ``observed.<node>.*``;
* heartbeats into ``zattera-live`` (``heartbeat.py``);
* the volume snapshot/restore/prune handlers (``shared.snapshots``) over ``<data>/volumes``;
* with ``builder`` set, the build handler (``builder.py``).

Cancelling it leaves the instances running for the next agent run to adopt, unless ``stop_on_exit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path

from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from services.agent.builder import Builder
from services.agent.docker_runtime import choose_launcher
from services.agent.forwarder import Forwarder
from services.agent.heartbeat import HeartbeatPublisher
from services.agent.mesh import PORT as MESH_PORT
from services.agent.mesh import Mesh, MeshError
from services.agent.mesh import available as mesh_unavailable
from services.agent.processes import PortAllocator
from services.agent.registration import NodeIdentity, register_node
from services.agent.reporter import ObservedReporter
from services.agent.runtime import ProcessRuntime, RuntimeContext
from services.agent.settings import AgentSettings
from shared import keys as K
from shared.activation import request_activation
from shared.clock import Clock, RealClock
from shared.natsio import Connection
from shared.routeclient import RouteClient
from shared.runtime_note import write_runtime_note
from shared.security.views import request_view
from shared.snapshots import serve_snapshot_requests
from shared.state.feed import StateView
from shared.txn import Writer

log = logging.getLogger(__name__)

FINAL_FLUSH_TIMEOUT = 5.0
ACTIVATE_TIMEOUT = 10.0


def view_filters(node_id: str) -> tuple[str, ...]:
    """The state keys an agent watches: what it runs and reports, every node record (its mesh peers), and the
    releases and volumes it runs with."""
    return (
        f"{K.ASSIGNMENT}.{node_id}.*",
        f"{K.OBSERVED}.{node_id}.*",
        f"{K.NODE}.*",
        f"{K.RELEASE}.*",
        f"{K.VOLUME}.*",
    )


class Agent:
    def __init__(
        self,
        conn: Connection,
        settings: AgentSettings,
        data_dir: Path,
        *,
        clock: Clock | None = None,
        secured: bool = False,
    ) -> None:
        """``secured``: the agent runs with a node credential. Secured or not, its view pulls from the one
        consumer control opens for it (:mod:`shared.security.views`); only a secured agent may not create it
        itself when no control service answers."""
        if not settings.node_id:
            raise ValueError("the agent needs a node id")
        self.conn = conn
        self.settings = settings
        self.node_id = settings.node_id
        self.data_dir = data_dir
        self.clock: Clock = clock or RealClock()
        self.view = StateView(
            conn,
            name=f"agent-{self.node_id}",
            filters=view_filters(self.node_id),
            open_consumer=partial(request_view, conn, settings.node_id, secured=secured),
        )
        self.writer = Writer(conn, self.view)
        self.reporter = ObservedReporter(self.writer, self.node_id, retry_delay=settings.report_retry)
        self.node: pb.Node | None = None
        self.runtime: ProcessRuntime | None = None
        self.registered = asyncio.Event()
        # Instance secrets come sealed to this key: a fresh pair per registration (re-registering rotates it),
        # the private half never leaves this process (docs/secrets.md).
        self.secrets_key = PrivateKey.generate()
        self.forwarder: Forwarder | None = None
        if settings.private_network:
            self.forwarder = Forwarder(
                activate=self._activate,
                dns_port=settings.dns_port,
                state_path=data_dir / "forwarder" / "consumers.json",
            )

    @property
    def volumes_dir(self) -> Path:
        return self.data_dir / "volumes"

    def env_of(self, assignment_id: str) -> str:
        """The env id of one of this node's assignments ("" once it is gone): a metrics label."""
        assignment = self.view.assignment(assignment_id)
        return assignment.environment_id if assignment is not None else ""

    async def _activate(self, env_id: str) -> None:
        """Ask the activator to wake a scale-to-zero env a held connection waits for."""
        await request_activation(self.conn, env_id, self.node_id, timeout=ACTIVATE_TIMEOUT)

    async def _forward(self, forwarder: Forwarder) -> None:
        """The forwarder follows the route snapshots, as the proxies do. Its failure is logged and leaves the
        rest of the agent running: the apps keep running, only private networking stops on this node."""
        routes = RouteClient(self.data_dir / "forwarder" / "routes.pb", node_id=self.node_id)
        updates = routes.updates()
        try:
            await routes.start(self.conn)
            await forwarder.run(
                updates, lambda: {a.environment_id for a in self.view.assignments_by_node(self.node_id)}
            )
        except Exception as exc:
            log.error("agent %s: private networking stopped: %s: %s", self.node_id, type(exc).__name__, exc)
        finally:
            forwarder.stop()  # first and without awaiting: this task may be cancelled again while cleaning up
            updates.close()
            await routes.stop()

    def _mesh(self) -> Mesh | None:
        """The WireGuard mesh, when this node has a mesh address and an endpoint (cluster of machines)."""
        settings = self.settings
        if not (settings.mesh_ip and settings.public_endpoint):
            return None
        why = mesh_unavailable()
        if why:
            log.warning(
                "agent %s: no mesh: %s; %s must be reachable by other means", self.node_id, why, settings.mesh_ip
            )
            return None
        mesh = Mesh(self.data_dir, self.node_id, settings.mesh_ip)
        try:
            mesh.start()
        except MeshError as exc:
            log.error("agent %s: no mesh: %s", self.node_id, exc)
            return None
        return mesh

    async def run(self) -> None:
        settings = self.settings
        identity = NodeIdentity.from_host(
            self.node_id,
            self.data_dir,
            labels=settings.labels,
            roles=settings.roles,
            builder=settings.builder,
            mesh_ip=settings.mesh_ip,
        )
        choice = await choose_launcher(settings)
        launcher = choice.launcher
        write_runtime_note(self.data_dir, launcher.name, choice.reason)
        identity = replace(
            identity,
            secrets_public_key=bytes(self.secrets_key.public_key),
            runtime=launcher.name,
            runtime_reason=choice.reason,
        )
        mesh = self._mesh()
        if mesh is not None:
            endpoint = settings.public_endpoint
            endpoint = endpoint if ":" in endpoint else f"{endpoint}:{MESH_PORT}"
            identity = replace(identity, wireguard_public_key=mesh.public_key, public_endpoints=(endpoint,))
        await self.view.start()
        tasks: list[asyncio.Task[None]] = []
        try:
            self.node = await register_node(self.conn, self.writer, identity, self.clock)
            self.registered.set()
            self.runtime = ProcessRuntime(
                RuntimeContext(
                    conn=self.conn,
                    view=self.view,
                    reporter=self.reporter,
                    settings=settings,
                    node_id=self.node_id,
                    os_arch=identity.os_arch,
                    instances_dir=self.data_dir / "instances",
                    volumes_dir=self.volumes_dir,
                    ports=PortAllocator(),
                    secrets_key=self.secrets_key,
                    network_env=self.forwarder.instance_env if self.forwarder is not None else None,
                    launcher=launcher,
                    clock=self.clock,
                )
            )
            heartbeat = HeartbeatPublisher(
                self.conn,
                self.node_id,
                self.data_dir,
                self.runtime.running,
                self.clock,
                interval=settings.heartbeat_interval,
                env_of=self.env_of,
            )
            self.volumes_dir.mkdir(parents=True, exist_ok=True)
            runtime_task = asyncio.create_task(self.runtime.run(), name="runtime")
            tasks = [
                asyncio.create_task(self.reporter.run(), name="reporter"),
                asyncio.create_task(heartbeat.run(), name="heartbeat"),
                asyncio.create_task(
                    serve_snapshot_requests(self.conn, self.node_id, self.volumes_dir), name="snapshots"
                ),
            ]
            if self.forwarder is not None:
                tasks.append(asyncio.create_task(self._forward(self.forwarder), name="forwarder"))
            if mesh is not None:
                tasks.append(asyncio.create_task(mesh.run(self.view), name="mesh"))
            if settings.builder:
                builder = Builder(
                    self.conn,
                    self.node_id,
                    self.data_dir / "builds",
                    os_arch=identity.os_arch,
                    keepalive=settings.build_keepalive,
                    docker_host=settings.docker_host,
                )
                tasks.append(asyncio.create_task(builder.serve(), name="builder"))
            log.info("agent %s: running (data dir %s, %s runtime)", self.node_id, self.data_dir, launcher.name)
            try:
                await asyncio.gather(runtime_task, *tasks)
            finally:
                # Cancelled already when the gather was: a second cancel would cut its shutdown (stopping the
                # instances with stop_on_exit, reporting them STOPPED) short.
                if not runtime_task.cancelling():
                    runtime_task.cancel()
                await asyncio.gather(runtime_task, return_exceptions=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.reporter.flush(), FINAL_FLUSH_TIMEOUT)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await launcher.close()  # first: it saves where each container's output was copied up to
            finally:
                await self.view.stop()
