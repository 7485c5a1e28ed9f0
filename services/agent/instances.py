"""One assignment's instance on this node: :class:`InstanceSupervisor` starts it, watches it, restarts it
by the restart policy, stops it, and reports what it observes; :class:`RuntimeContext` is what every
supervisor of the node shares. The rules it follows are in ``runtime.py``'s description."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from services.agent.addon_env import expand_service_refs, seed_fork
from services.agent.health import HealthMonitor, min_healthy_time, probe_for, seconds
from services.agent.images import ImageError, PreparedImage
from services.agent.instance_env import bind_address, config_of, instance_env, launch_plan, port_names, resolve_volumes
from services.agent.launchers import LABEL_ASSIGNMENT, InstanceHandle, Launcher, LaunchPlan, ProcessLauncher
from services.agent.logs import STREAM_FILES, TAIL_READ, InstanceLogShipper, ShipperSettings
from services.agent.processes import InstanceRecord, PortAllocator
from services.agent.reporter import ObservedReporter
from services.agent.restart_policy import Outcome, RestartPolicy, StartHistory, Step, Verdict
from services.agent.settings import AgentSettings
from shared import keys as K
from shared.applogs import STDOUT, describe_exit, instance_exit
from shared.clock import Clock, RealClock, stamp, wait_or_timer
from shared.connection import Connection
from shared.registryauth import split_registry_auth
from shared.secrets import SecretsServiceSilent, SecretsUnavailable, fetch_secrets
from shared.state.feed import StateView
from shared.tasks import cancel_and_wait
from shared.telemetry import span

log = logging.getLogger(__name__)

RUN = pb.ASSIGNMENT_DESIRED_RUN


PENDING = pb.INSTANCE_STATE_PENDING


PULLING = pb.INSTANCE_STATE_PULLING


STARTING = pb.INSTANCE_STATE_STARTING


RUNNING = pb.INSTANCE_STATE_RUNNING


HEALTHY = pb.INSTANCE_STATE_HEALTHY


UNHEALTHY = pb.INSTANCE_STATE_UNHEALTHY


FAILED = pb.INSTANCE_STATE_FAILED


STOPPED = pb.INSTANCE_STATE_STOPPED


_UP_STATES = (RUNNING, HEALTHY, UNHEALTHY)


def read_tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` complete lines of a file (at most its last 16 KiB); [] when it is not there."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - TAIL_READ))
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    if size > TAIL_READ:
        text = text[1:]  # the first one is cut
    return text[-lines:] if lines else []


@dataclass
class RuntimeContext:
    """What every supervisor of this node shares."""

    conn: Connection
    view: StateView
    reporter: ObservedReporter
    settings: AgentSettings
    node_id: str
    os_arch: str
    instances_dir: Path
    volumes_dir: Path
    ports: PortAllocator
    secrets_key: PrivateKey | None = None
    """This registration's node key; instance secrets are sealed to its public half (None: no secrets)."""
    network_env: Callable[[pb.Assignment, pb.Release], Awaitable[Mapping[str, str]]] | None = None
    """The node forwarder's variables for an instance (None: private networking off)."""
    launcher: Launcher = field(default_factory=ProcessLauncher)
    """The node's runtime: bare processes or containers (``launchers.py``)."""
    clock: Clock = field(default_factory=RealClock)


class InstanceSupervisor:
    """Runs and reports one assignment; see the module docstring."""

    def __init__(
        self,
        ctx: RuntimeContext,
        assignment: pb.Assignment,
        *,
        adopted: tuple[InstanceHandle, InstanceRecord] | None = None,
    ) -> None:
        self.ctx = ctx
        self.assignment = assignment
        self.assignment_id = assignment.meta.id
        self.dir = ctx.instances_dir / self.assignment_id
        self.waiting_on_state = False
        """Waiting for a release, an image or a volume lease: re-evaluated on any such change."""
        self._wake = asyncio.Event()
        self._handle: InstanceHandle | None = None
        self._exit: asyncio.Task[int | None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._container_id = ""
        self._policy = RestartPolicy.of(ctx.settings)
        self._history = StartHistory()
        self._ports: dict[str, int] = {}
        self._workdir = Path()
        self._env: dict[str, str] = {}
        self._secret_names: frozenset[str] = frozenset()
        self._restarts = 0
        self._ever_started = False
        self._stop_grace = ctx.settings.default_stop_grace
        self._last_exit: pb.InstanceExit | None = None
        self._logs = InstanceLogShipper(
            ctx.conn,
            self.dir,
            environment_id=assignment.environment_id,
            instance_id=self.assignment_id,
            node_id=ctx.node_id,
            settings=ShipperSettings.of(ctx.settings),
        )
        self._logs.release_id = assignment.release_id
        self._logs_task: asyncio.Task[None] | None = None
        if adopted is not None:
            handle, record = adopted
            self._history = StartHistory(config=record.config)
            self._ports = dict(record.ports)
            self._restarts = record.restarts
            self._workdir = Path(record.workdir)
            self._env = dict(record.env)
            self._ever_started = True
            ctx.ports.hold(self._ports)
            self._attach(handle)

    # ------------------------------------------------------------------ control from the runtime

    @property
    def handle(self) -> InstanceHandle | None:
        return self._handle

    @property
    def parked(self) -> bool:
        """Given up on (FAILED), or a job that ended: nothing runs until the config changes."""
        return self._history.parked

    def update(self, assignment: pb.Assignment) -> None:
        """A newer version of the assignment (the view replaces the object on every write)."""
        if assignment is not self.assignment:
            self.assignment = assignment
            self._wake.set()

    def poke(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        self._logs_task = asyncio.create_task(self._logs.run(), name=f"logs:{self.assignment_id}")
        if self._handle is not None:
            self._resume_watching()
        try:
            while True:
                await self._step()
        finally:
            # The process itself stays (adopted by the next agent run, or stopped by remove/stop_for_exit),
            # and so do its unshipped lines (the next run resumes from the cursor).
            self._cancel_watchers()
            await cancel_and_wait(self._logs_task)

    async def remove(self) -> None:
        """The assignment vanished: stop the process, ship its last lines, drop the directory and the observed
        key."""
        await self._stop()
        self.ctx.ports.release(self._ports)
        await self._logs.drain(self.ctx.settings.log_drain_timeout)
        await asyncio.to_thread(shutil.rmtree, self.dir, ignore_errors=True)  # its logs: off the loop
        self.ctx.reporter.forget(self.assignment_id)

    async def stop_for_exit(self) -> None:
        """The agent stops and takes its instances with it."""
        if self._handle is not None:
            await self._stop()
            self._report(STOPPED, message="agent stopped")
            await self._logs.drain(self.ctx.settings.log_drain_timeout)

    # ------------------------------------------------------------------ the convergence step

    async def _step(self) -> None:
        a = self.assignment
        release = self.ctx.view.release(a.release_id)
        if release is not None:
            self._stop_grace = seconds(release.service.stop_grace, self.ctx.settings.default_stop_grace)
        if a.desired != RUN:
            self.waiting_on_state = False
            await self._stop()
            self._report(STOPPED)
            await self._changed()
            return
        if self._handle is not None:
            if release is not None and config_of(a, release) != self._history.config:
                log.info("%s: config changed; recreating its process", self.assignment_id)
                await self._stop()
                return
            await self._watch()
            return
        if release is None or not release.image_ref:
            why = f"waiting for release {a.release_id}" if release is None else "waiting for the release's image"
            await self._wait_on_state(why)
            return
        now = self.ctx.clock.now()
        plan = self._policy.before_start(
            self._history,
            config_of(a, release),
            now,
            job_ended_before=bool(a.job_id) and not self._ever_started and a.observed.state in (STOPPED, FAILED),
        )
        self._history = plan.history
        if plan.step is Step.PARKED:
            self.waiting_on_state = False
            await self._changed()
            return
        volumes, blocked = resolve_volumes(self.ctx.view, a, release, self.ctx.volumes_dir, now)
        if blocked:
            await self._wait_on_state(blocked)
            return
        self.waiting_on_state = False
        if plan.step is Step.WAIT:
            await self._changed(plan.wait)
            return
        await self._start(a, release, volumes)

    async def _wait_on_state(self, why: str) -> None:
        self.waiting_on_state = True
        self._report(PENDING, message=why)
        await self._changed()

    async def _changed(self, timeout: float | None = None) -> None:
        await wait_or_timer(self.ctx.clock, self._wake.wait(), timeout)
        self._wake.clear()

    async def _start(self, a: pb.Assignment, release: pb.Release, volumes: Mapping[str, Path]) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the agent's own: logs, state (not the app's)
        self._report(PULLING)
        try:  # first: a pull may need the environment's registry credentials (one of its sealed secrets)
            secrets, registry_auth = split_registry_auth(await self._secrets(a, release))
        except SecretsServiceSilent as exc:  # a control plane starting: not the app's failure, not counted
            outcome = self._policy.after_unanswered(self._history, self.ctx.clock.now())
            self._history = outcome.history
            self._report(STARTING, message=f"secrets: {exc}; asking again in {outcome.delay:.1f}s")
            return
        except SecretsUnavailable as exc:
            self._failed_attempt(f"secrets: {exc}", None)
            return
        try:
            image = await self.ctx.launcher.prepare(
                self.ctx.conn, release.image_ref, self.dir, platform=self.ctx.os_arch, registry_auth=registry_auth
            )
        except ImageError as exc:
            self._failed_attempt(f"image: {exc}", None)
            return
        except Exception as exc:  # a NATS error while fetching: the next attempt may work
            self._failed_attempt(f"image: {type(exc).__name__}: {exc}", None)
            return
        command = image.command(a.job_command or release.service.command)
        if not command:
            self._failed_attempt("no command: the image has none and the service sets none", None)
            return
        if not self._ports:
            self._ports = {name: self.ctx.ports.allocate() for name in port_names(release.service)}
        for path in volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        try:  # a managed database's point-in-time fork: the origin's backups first (addon_env.py)
            await seed_fork(release, volumes, self.ctx.volumes_dir)
        except OSError as exc:
            self._failed_attempt(f"restore: {exc}", None)
            return
        env = instance_env(
            a, image, self._ports, volumes, {**release.service.vars, **secrets}, bind=bind_address(self.ctx.settings)
        )
        if self.ctx.network_env is not None:  # private networking: ZATTERA_DNS, ZATTERA_SERVICE_* (docs/networking.md)
            env.update(await self.ctx.network_env(a, release))
        expand_service_refs(env)  # ${ZATTERA_SERVICE_*} in an attached database's URL (addon_env.py)
        self._secret_names = frozenset(secrets)
        # Shielded: once spawned, the process must be attached and recorded even if this task is
        # cancelled meanwhile (assignment removed, agent stopping), or nobody would ever stop it.
        launching = asyncio.ensure_future(self._launch(command, image, env, launch_plan(release, volumes)))
        try:
            handle = await asyncio.shield(launching)
        except asyncio.CancelledError:
            await asyncio.gather(launching, return_exceptions=True)
            raise
        except OSError as exc:
            self._failed_attempt(f"start: {exc}", None)
            return
        log.info("%s: started pid %d (%s) on ports %s", self.assignment_id, handle.pid, command, self._ports)
        self._start_health(release)

    async def _secrets(self, a: pb.Assignment, release: pb.Release) -> dict[str, str]:
        """The release's secret values, fetched sealed to this node at each start and held in memory only."""
        if not release.service.secrets:
            return {}
        if self.ctx.secrets_key is None:
            raise SecretsUnavailable("this agent has no node key")
        return await fetch_secrets(self.ctx.conn, self.ctx.node_id, self.ctx.secrets_key, a.meta.id)

    async def _launch(
        self, command: list[str], image: PreparedImage, env: dict[str, str], plan: LaunchPlan
    ) -> InstanceHandle:
        # A child of the assignment's last write (the orchestrator's or scheduler's transition span).
        parent = self.ctx.view.trace_headers(K.assignment(self.ctx.node_id, self.assignment_id)) or None
        self._logs.process_starting()
        self._logs.release_id = self.assignment.release_id
        with span("agent.instance.start", headers=parent, assignment_id=self.assignment_id, node_id=self.ctx.node_id):
            handle = await self.ctx.launcher.spawn(
                command,
                image=image,
                env=env,
                instance_dir=self.dir,
                plan=plan,
                labels={LABEL_ASSIGNMENT: self.assignment_id},
            )
        if self._ever_started:
            self._restarts += 1
        self._ever_started = True
        self._workdir, self._env = image.workdir, env
        self._attach(handle)
        record = InstanceRecord(
            assignment_id=self.assignment_id,
            config=self._history.config,
            pid=handle.pid,
            create_time=handle.create_time,
            container_id=handle.container_id,
            ports=self._ports,
            restarts=self._restarts,
            workdir=str(image.workdir),
            # Never a secret on disk: an adopted process's exec health checks run without them.
            env={k: v for k, v in env.items() if k not in self._secret_names},
            sandbox_uid=handle.sandbox_uid,
        )
        await asyncio.to_thread(record.save, self.dir)  # two syncs: off the loop, where other instances start
        return handle

    def _resume_watching(self) -> None:
        """A process this supervisor did not start in this run (adopted): probe it again."""
        assert self._handle is not None
        log.info("%s: watching pid %d", self.assignment_id, self._handle.pid)
        self._start_health(self.ctx.view.release(self.assignment.release_id))

    def _start_health(self, release: pb.Release | None) -> None:
        if self.assignment.job_id:
            self._report(RUNNING)  # a job has no health: it runs until it exits
            return
        if release is None:  # gone meanwhile: the next step stops the process
            self._report(RUNNING)
            return
        minimum = min_healthy_time(release.service, self.ctx.settings.min_healthy_time)
        probe = probe_for(release.service, self._ports, host=bind_address(self.ctx.settings), min_healthy=minimum)
        self._report(RUNNING)
        container_id = self._container_id

        def on_state(state: int) -> None:
            if self._container_id == container_id and self._handle is not None:
                self._report(state)

        monitor = HealthMonitor(
            probe,
            on_state,
            cwd=self._workdir,
            env=self._env,
            startup_interval=self.ctx.settings.startup_probe_interval,
            clock=self.ctx.clock,
            exec_check=self._handle.exec_check if self._handle is not None else None,
        )
        self._monitor = asyncio.create_task(monitor.run(), name=f"health:{self.assignment_id}")

    async def _watch(self) -> None:
        """Until the process exits or something changes."""
        assert self._handle is not None
        if self._exit is None:
            self._exit = asyncio.create_task(self._handle.wait(), name=f"exit:{self.assignment_id}")
        waker = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait({self._exit, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()
        if self._exit.done():
            await self._on_exit(self._exit.result())
        else:
            self._wake.clear()

    async def _on_exit(self, code: int | None) -> None:
        handle = self._handle
        assert handle is not None
        outcome = self._policy.after_exit(self._history, self.ctx.clock.now(), job=bool(self.assignment.job_id))
        self._history = outcome.history
        self._detach()
        handle.kill_leftovers()
        await self._logs.drain(self.ctx.settings.log_drain_timeout)
        self._last_exit = instance_exit(code, self._logs.stderr_tail(), now_ns=round(self.ctx.clock.now() * 1e9))
        self._last_exit.oom_killed = handle.oom_killed
        message = f"exited ({describe_exit(self._last_exit)})"
        log.info("%s: pid %d %s after %.1fs", self.assignment_id, handle.pid, message, outcome.ran)
        if outcome.verdict is Verdict.JOB_ENDED:
            self._report(STOPPED if code == 0 else FAILED, message=message, exit_code=code, output=self._output_tail())
            return
        self._report_outcome(outcome, message, code)

    def _output_tail(self) -> list[str]:
        """A job's last stdout lines, then its last stderr lines (what ``zattera jobs show`` prints)."""
        stdout = read_tail(self.dir / STREAM_FILES[STDOUT], self.ctx.settings.log_stderr_tail)
        return stdout + (self._last_exit.stderr_tail[:] if self._last_exit is not None else [])

    def _failed_attempt(self, message: str, exit_code: int | None) -> None:
        outcome = self._policy.after_failed_start(self._history, self.ctx.clock.now())
        self._history = outcome.history
        self._report_outcome(outcome, message, exit_code)

    def _report_outcome(self, outcome: Outcome, message: str, exit_code: int | None) -> None:
        failures = outcome.history.failures
        if outcome.verdict is Verdict.GIVE_UP:
            log.warning("%s: %s; FAILED after %d failed starts", self.assignment_id, message, failures)
            self._report(FAILED, message=f"{message}; gave up after {failures} failed starts", exit_code=exit_code)
            return
        self._report(STARTING, message=f"{message}; restarting in {outcome.delay:.1f}s", exit_code=exit_code)

    # ------------------------------------------------------------------ process bookkeeping

    def _attach(self, handle: InstanceHandle) -> None:
        self._handle = handle
        self._container_id = handle.container_id
        self._history = self._policy.started(self._history, self.ctx.clock.now())

    def _cancel_watchers(self) -> None:
        for task in (self._monitor, self._exit):
            if task is not None:
                task.cancel()
        self._exit = self._monitor = None

    def _detach(self) -> None:
        self._cancel_watchers()
        self._handle = None

    async def _stop(self) -> None:
        handle = self._handle
        if handle is None:
            return
        if self._monitor is not None:
            self._monitor.cancel()
        log.info("%s: stopping pid %d (grace %.1fs)", self.assignment_id, handle.pid, self._stop_grace)
        with span("agent.instance.stop", assignment_id=self.assignment_id, node_id=self.ctx.node_id):
            await handle.stop(self._stop_grace)
        self._detach()

    def _report(
        self, state: int, *, message: str = "", exit_code: int | None = None, output: list[str] | None = None
    ) -> None:
        observed = pb.AssignmentObserved(
            state=state,  # type: ignore[arg-type]
            container_id=self._container_id,
            restarts=self._restarts,
            message=message,
        )
        if exit_code is not None:
            observed.exit_code = exit_code
        if self._last_exit is not None:
            observed.last_exit.CopyFrom(self._last_exit)
        if state in _UP_STATES:
            observed.mesh_port_bindings.update(self._ports)
        if self.assignment.job_id and self._history.started_at:
            stamp(observed.started_at, self._history.started_at)
        observed.output_tail.extend(output or ())
        stamp(observed.updated_at, self.ctx.clock.now())
        self.ctx.reporter.report(self.assignment_id, observed)
