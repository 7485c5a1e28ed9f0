"""The node agent: registration, the process runtime, heartbeats, and (when asked) builds and volume snapshots.

``Agent.run`` loads a state view of the keys it needs (:func:`view_filters`: its own assignments, observed
reports and node record, every release and volume; exactly what an agent credential may read, SECURITY.md),
registers ``node.<id>``, then runs until cancelled:

* the observed-state reporter and the runtime (``runtime.py``; processes or containers: ``launchers.py``,
  ``docker_runtime.py``, chosen at start by :func:`node_runtime`, with the processes sandboxed when the
  machine can: ``sandbox.py``), which converge this node's assignments and write only ``observed.<node>.*``;
* heartbeats into ``zattera-live`` (``heartbeat.py``);
* the volume snapshot/restore/prune handlers (``services/agent/snapshots/``) over ``<data>/volumes``;
* with ``builder`` set, the build handler (``builder.py``).

Cancelling it leaves the instances running for the next agent run to adopt, unless ``stop_on_exit``.

The data directory is the agent's alone (0700): its credential (``node.creds``), the instances' directories,
volumes, builds and the sandbox's uid table. Apps never see it (a sandbox shows each only its own parts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from services.agent.builder import Builder
from services.agent.firewall import Fence
from services.agent.forwarder import Forwarder
from services.agent.heartbeat import HeartbeatPublisher
from services.agent.instances import RuntimeContext
from services.agent.kernelnet import KernelPath
from services.agent.launchers import PROCESS, TENANT_KEY, Launcher, ProcessLauncher
from services.agent.mesh import PORT as MESH_PORT
from services.agent.mesh import Mesh, MeshError
from services.agent.mesh import available as mesh_unavailable
from services.agent.processes import PortAllocator
from services.agent.registration import NodeIdentity, register_node
from services.agent.reporter import ObservedReporter
from services.agent.runtime import ProcessRuntime
from services.agent.runtime_choice import choose_launcher, docker_launcher
from services.agent.sandbox import (
    CONTAINER,
    NONE,
    SANDBOX,
    Isolation,
    IsolationRefused,
    Sandbox,
    Support,
    decide_isolation,
    hook_runner,
    node_python_paths,
    probe,
)
from services.agent.sandbox_users import UidTable
from services.agent.settings import AgentSettings
from services.agent.snapshots.handlers import HookRunner, SnapshotAgent, run_hook_in_shell, serve_snapshot_requests
from shared import keys as K
from shared.activation import request_activation
from shared.addons.tunnel import serve_psql_sessions
from shared.backoff import exponential
from shared.clock import Clock, RealClock
from shared.connection import Connection
from shared.routeclient import RouteClient
from shared.runtime_note import write_runtime_note
from shared.security.views import ViewUnavailable, request_view
from shared.state.feed import StateView
from shared.txn import Writer

log = logging.getLogger(__name__)

FINAL_FLUSH_TIMEOUT = 5.0
ACTIVATE_TIMEOUT = 10.0
VIEW_RETRY_FIRST = 0.1
VIEW_RETRY_MOST = 2.0
"""Seconds between asks for the view while the control plane does not answer yet (doubling from the first)."""


@dataclass(frozen=True)
class NodeRuntime:
    """How this node runs instances: the launcher, its isolation and, when sandboxed, the sandbox (builds
    use it too)."""

    launcher: Launcher
    isolation: Isolation
    sandbox: Sandbox | None = None
    reason: str = ""
    """Why this runtime (``runtime_choice.choose_launcher``)."""
    uids: UidTable | None = None
    """The environments' users (the sandbox's, a docker node's containers'): the network fence's uid range."""


async def node_runtime(settings: AgentSettings, data_dir: Path, *, secured: bool) -> NodeRuntime:
    """The runtime ``settings`` ask for, its instances sandboxed when the machine can
    (:func:`sandbox.decide_isolation`), and a builder's steps too (also on a docker node: they run on the
    host); :class:`IsolationRefused` when apps would run unisolated where that is not allowed. A node without
    isolation says so in its log (the terminal of an agent started by hand) and its node record."""
    choice = await choose_launcher(settings)
    launcher = choice.launcher
    support = Support(problem="turned off (ZATTERA_AGENT_SANDBOX=off)")
    if settings.sandbox != "off" and (launcher.name == PROCESS or settings.builder):
        support = await probe(settings.sandbox_bwrap)
    try:
        decide = partial(
            decide_isolation,
            mode=settings.sandbox,
            support=support,
            secured=secured,
            allow_unisolated=settings.allow_unisolated,
        )
        isolation = decide(runtime=launcher.name)
        if settings.builder and launcher.name != PROCESS:
            decide(runtime=PROCESS, what="builds")  # a docker node's builds run on the host
    except IsolationRefused:
        await launcher.close()
        raise
    sandbox = None
    uids = None
    sandboxing = support.ok and settings.sandbox != "off"
    docker = docker_launcher(launcher)
    if sandboxing or docker is not None:
        uids = UidTable(data_dir / "sandbox", base=settings.sandbox_uid_base, count=settings.sandbox_uid_count)
    if docker is not None:
        docker.uids = uids  # each environment's containers run as its user, fenced like the sandbox's
    if sandboxing and uids is not None:
        read_only = [*node_python_paths(), *settings.sandbox_read_only]
        hidden = (data_dir, *(Path(p) for p in settings.sandbox_hidden))
        sandbox = Sandbox(support, uids, read_only=read_only, hidden=hidden)
        if isinstance(launcher, ProcessLauncher):
            launcher.sandbox = sandbox
    if isolation.kind == NONE:
        log.warning(
            "agent %s: apps are NOT isolated on this node (%s): they run as the agent's user and can read what"
            " it can (SECURITY.md)",
            settings.node_id,
            isolation.problem,
        )
    elif settings.builder and sandbox is None:
        log.warning("agent %s: build steps are NOT isolated on this node (%s)", settings.node_id, support.problem)
    return NodeRuntime(launcher, isolation, sandbox, choice.reason, uids)


def private_directory(path: Path) -> Path:
    """``path`` made (if missing) and readable by its owner only."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


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
        runtime: NodeRuntime | None = None,
    ) -> None:
        """``secured``: the agent runs with a node credential. Secured or not, its view pulls from the one
        consumer control opens for it (:mod:`shared.security.views`); only a secured agent may not create it
        itself when no control service answers. ``runtime``: chosen already (:func:`node_runtime`), else at
        :meth:`run`."""
        if not settings.node_id:
            raise ValueError("the agent needs a node id")
        self.conn = conn
        self.settings = settings
        self.node_id = settings.node_id
        self.data_dir = data_dir
        self.secured = secured
        self.node_runtime = runtime
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
        self.handover = False
        """Set when the agent stops for another to adopt its instances at once: its apps' firewall stays."""
        # Instance secrets come sealed to this key: a fresh pair per registration (re-registering rotates it),
        # the private half never leaves this process (docs/secrets.md).
        self.secrets_key = PrivateKey.generate()
        self.forwarder: Forwarder | None = None
        if settings.private_network:
            self.forwarder = Forwarder(
                activate=self._activate,
                dns_port=settings.dns_port,
                state_path=data_dir / "forwarder" / "consumers.json",
                kernel=KernelPath(str(data_dir.resolve())) if settings.private_network_kernel else None,
            )

    def _forwarding(self) -> tuple[dict[str, int], int]:
        assert self.forwarder is not None
        return self.forwarder.old_connections(), self.forwarder.version

    @property
    def volumes_dir(self) -> Path:
        return self.data_dir / "volumes"

    def env_of(self, assignment_id: str) -> str:
        """The env id of one of this node's assignments ("" once it is gone): a metrics label."""
        assignment = self.view.assignment(assignment_id)
        return assignment.environment_id if assignment is not None else ""

    def _pre_hooks(self) -> HookRunner:
        """Snapshot pre-hooks: on a sandboxing node sandboxed as their volume's environment's user, else in
        a shell on the host."""
        sandbox = self.node_runtime.sandbox if self.node_runtime is not None else None
        if sandbox is None:
            return run_hook_in_shell

        def uid_of(directory: Path) -> int:
            volume = self.view.volume(directory.name)
            return sandbox.uid(TENANT_KEY + (volume.environment_id if volume is not None else directory.name))

        return hook_runner(sandbox, uid_of)

    async def _activate(self, env_id: str) -> None:
        """Ask the activator to wake a scale-to-zero env a held connection waits for."""
        await request_activation(self.conn, env_id, self.node_id, timeout=ACTIVATE_TIMEOUT)

    async def _forward(self, forwarder: Forwarder) -> None:
        """The forwarder follows the route snapshots, as the proxies do. Its failure is logged and leaves the
        rest of the agent running: the apps keep running, only private networking stops on this node."""
        routes = RouteClient(self.data_dir / "forwarder" / "routes.pb", node_id=self.node_id)
        updates = routes.updates()
        try:
            path = await forwarder.start_kernel()
            log.info("agent %s: private network: %s", self.node_id, path)
            await routes.start(self.conn)
            await forwarder.run(
                updates, lambda: {a.environment_id for a in self.view.assignments_by_node(self.node_id)}
            )
        except Exception as exc:
            log.error("agent %s: private networking stopped: %s: %s", self.node_id, type(exc).__name__, exc)
        finally:
            # First and without awaiting: this task may be cancelled again while cleaning up. An agent handing
            # its instances over leaves the kernel path's rules for the next one (they keep carrying traffic).
            forwarder.stop(keep_rules=self.handover)
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

    async def _start_view(self) -> None:
        """Load the view once control opens it: ``zattera up`` starts the control plane and the local node
        together, so the join service may not serve ``zattera.view.open`` yet — a wait, not a failure (an
        agent that exited on it was restarted by the supervisor on every secure start)."""
        attempt = 0
        while True:
            try:
                await self.view.start()
                return
            except ViewUnavailable as exc:
                attempt += 1
                if attempt == 1:
                    log.info("agent %s: waiting for the control plane to open its view (%s)", self.node_id, exc)
                await self.clock.sleep(exponential(VIEW_RETRY_FIRST, attempt, VIEW_RETRY_MOST))

    async def _fence(self) -> Fence | None:
        """The firewall of the environments' users (firewall.py: sandboxed apps and build steps, a docker node's
        containers), installed; None when no app runs as such a user."""
        assert self.node_runtime is not None
        uids = self.node_runtime.uids
        if uids is None:
            return None
        settings = self.settings
        if not settings.sandbox_fence:
            return Fence(str(self.data_dir), range(0), problem="turned off (ZATTERA_AGENT_SANDBOX_FENCE=false)")
        servers = [f"{u.hostname}:{u.port or 4222}" for u in getattr(self.conn.nc, "servers", []) if u.hostname]
        launcher = self.node_runtime.launcher
        docker = docker_launcher(launcher)
        bridge = await docker.bridge_interface() if docker is not None else ""
        fence = Fence(
            str(self.data_dir),
            range(uids.base, uids.base + uids.count),
            nats_urls=servers,
            control_pids=settings.sandbox_fence_pids,
            allowed_ports=settings.sandbox_fence_allow,
            fixed_ports=settings.sandbox_fence_ports,
            interfaces=[bridge] if bridge else [],
        )
        await fence.install()
        return fence

    async def run(self) -> None:
        settings = self.settings
        private_directory(self.data_dir)
        if self.node_runtime is None:
            self.node_runtime = await node_runtime(settings, self.data_dir, secured=self.secured)
        launcher = self.node_runtime.launcher
        isolation = self.node_runtime.isolation
        fence = await self._fence()
        if fence is not None and fence.problem:
            if isolation.kind in (SANDBOX, CONTAINER):
                isolation = replace(isolation, problem=fence.problem)
            log.warning(
                "agent %s: apps and builds are NOT fenced from this machine's control-plane ports (%s):"
                " on an open cluster they can connect to NATS (SECURITY.md)",
                self.node_id,
                fence.problem,
            )
        identity = NodeIdentity.from_host(
            self.node_id,
            self.data_dir,
            labels=settings.labels,
            roles=settings.roles,
            builder=settings.builder,
            mesh_ip=settings.mesh_ip,
        )
        write_runtime_note(self.data_dir, launcher.name, self.node_runtime.reason, isolation.describe())
        identity = replace(
            identity,
            secrets_public_key=bytes(self.secrets_key.public_key),
            runtime=launcher.name,
            runtime_reason=self.node_runtime.reason,
            isolation=isolation.kind,
            isolation_problem=isolation.problem,
        )
        mesh = self._mesh()
        if mesh is not None:
            endpoint = settings.public_endpoint
            endpoint = endpoint if ":" in endpoint else f"{endpoint}:{MESH_PORT}"
            identity = replace(identity, wireguard_public_key=mesh.public_key, public_endpoints=(endpoint,))
        await self._start_view()
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
                    instances_dir=private_directory(self.data_dir / "instances"),
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
                forwarding=self._forwarding if self.forwarder is not None else None,
            )
            private_directory(self.volumes_dir)
            runtime_task = asyncio.create_task(self.runtime.run(), name="runtime")
            tasks = [
                asyncio.create_task(self.reporter.run(), name="reporter"),
                asyncio.create_task(heartbeat.run(), name="heartbeat"),
                asyncio.create_task(
                    serve_snapshot_requests(
                        SnapshotAgent(self.conn, self.node_id, self.volumes_dir, hook_runner=self._pre_hooks())
                    ),
                    name="snapshots",
                ),
                asyncio.create_task(serve_psql_sessions(self.conn, self.node_id, self.volumes_dir), name="psql"),
            ]
            if self.forwarder is not None:
                tasks.append(asyncio.create_task(self._forward(self.forwarder), name="forwarder"))
            if fence is not None and not fence.problem:
                tasks.append(asyncio.create_task(fence.keep(), name="fence"))
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
                    sandbox=self.node_runtime.sandbox,
                )
                tasks.append(asyncio.create_task(builder.serve(), name="builder"))
            log.info(
                "agent %s: running (data dir %s, %s runtime, apps %s)",
                self.node_id,
                self.data_dir,
                launcher.name,
                isolation.describe(),
            )
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
                try:
                    await self.view.stop()
                finally:
                    # Instances left running for the next agent (an upgrade) stay fenced until it takes over.
                    if fence is not None and not fence.problem and not self.handover:
                        fence.remove()
