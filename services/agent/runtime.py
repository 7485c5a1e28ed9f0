"""The process runtime: converges this node's ``assignment.<node>.*`` into local processes.

One :class:`~services.agent.instances.InstanceSupervisor` (``instances.py``) per assignment owns its process
and its reports; :class:`ProcessRuntime` (this module) starts, recovers and removes them:

* desired RUN: fetch and unpack the release's image (``images.py``) into ``<data>/instances/<id>/``,
  give the instance a host port per declared port (``PORT`` = the "http" port or the first one,
  ``PORT_<NAME>`` for each; no declared port = one "http" port), tell it where to listen
  (``ZATTERA_BIND_ADDR`` and ``HOST`` = the node's mesh address, else 127.0.0.1: the address routes list
  for its replicas; health checks probe it there) and start its command. Reports go
  PULLING → RUNNING (ports in ``mesh_port_bindings``) → HEALTHY/UNHEALTHY from the health checks
  (``health.py``); without a declared healthcheck an instance is HEALTHY once it has run for the minimum
  healthy time and, with an HTTP port, accepts connections on it.
* The process's stdout and stderr are shipped to the env's log stream (``logs.py``). A process that exits
  has its last lines shipped and its exit (code or signal, last stderr lines) reported in
  ``observed.last_exit``, kept across restarts until the assignment goes;
* A job's assignment (``job_id`` set) runs ``job_command`` once, without health checks: its exit is reported
  STOPPED (code 0) or FAILED with the code, ``started_at`` and the last output lines, and it is never
  restarted, not even by a later agent run (docs/jobs.md). Any other process that exits is restarted
  with exponential backoff (reported STARTING with the exit code);
  after ``max_start_attempts`` failed starts of the same config (release, config hash, image) the
  assignment is parked FAILED. A run longer than ``stable_after`` resets the count. A config change
  (drift) stops the process and starts the new config with a fresh count. These rules are
  ``restart_policy.py`` (pure, on the injected clock); what an instance starts with is ``instance_env.py``.
* A stateful release's instance starts only under a valid lease of each of its volumes naming this node
  and this assignment; until then it is reported PENDING (not FAILED), as is an assignment whose release
  or image is not there yet. Volumes live at ``<data>/volumes/<volume id>``, passed to the process as
  ``ZATTERA_VOLUME_<NAME>`` (a process cannot mount them at ``mount_path``).
* desired STOP: SIGTERM, SIGKILL after ``ServiceSpec.stop_grace`` (default 10 s), then STOPPED (also for an
  assignment that never ran, so the scheduler can reap it).
* An assignment that vanished: its process is stopped the same way, its last output shipped, its directory
  (kept until then, also for a FAILED instance, for inspection) removed and its
  observed key deleted (no STOPPED report: there is nothing left to report on).

On start the runtime first looks at the instance directories a previous run left: a process that still
runs (verified by pid + creation time) for an assignment still desired RUN with the same config is
adopted; any other is stopped, and directories of vanished assignments are removed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

from services.agent.health import seconds
from services.agent.instance_env import config_of
from services.agent.instances import RUN, InstanceSupervisor, RuntimeContext
from services.agent.launchers import InstanceHandle
from services.agent.processes import STATE_FILE, InstanceRecord
from shared import keys as K
from shared.clock import wait_or_timer
from shared.tasks import raise_if_cancelling

log = logging.getLogger(__name__)


class ProcessRuntime:
    """Keeps one supervisor per assignment of this node; see the module docstring."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx
        self._supervisors: dict[str, tuple[InstanceSupervisor, asyncio.Task[None]]] = {}
        self._removing: dict[str, asyncio.Task[None]] = {}

    def running(self) -> dict[str, InstanceHandle]:
        """Assignment id → its live process (for the heartbeat's per-instance samples)."""
        return {aid: sup.handle for aid, (sup, _) in self._supervisors.items() if sup.handle is not None}

    def supervisor(self, assignment_id: str) -> InstanceSupervisor | None:
        entry = self._supervisors.get(assignment_id)
        return entry[0] if entry else None

    async def run(self) -> None:
        ctx = self.ctx
        feed = ctx.view.subscribe({K.ASSIGNMENT, K.RELEASE, K.VOLUME})
        try:
            await self.recover()
            while True:
                self.reconcile()
                await wait_or_timer(ctx.clock, feed.wait(), ctx.settings.reconcile_tick)
                feed.drain()
        finally:
            feed.close()
            await self.shutdown()

    def reconcile(self) -> None:
        ctx = self.ctx
        mine = {a.meta.id: a for a in ctx.view.assignments_by_node(ctx.node_id)}
        for aid, a in mine.items():
            entry = self._supervisors.get(aid)
            if entry is not None:
                entry[0].update(a)
                if entry[0].waiting_on_state:
                    entry[0].poke()
            elif aid not in self._removing:
                self._launch(InstanceSupervisor(ctx, a))
        for aid in [aid for aid in self._supervisors if aid not in mine]:
            sup, task = self._supervisors.pop(aid)
            self._removing[aid] = asyncio.create_task(self._remove(sup, task), name=f"remove:{aid}")
        for node_id, aid in ctx.view.observed_keys():
            if (
                node_id == ctx.node_id
                and aid not in mine
                and aid not in self._supervisors
                and aid not in self._removing
            ):
                ctx.reporter.forget(aid)

    def _launch(self, sup: InstanceSupervisor) -> None:
        self._supervisors[sup.assignment_id] = (sup, asyncio.create_task(self._supervise(sup), name=sup.assignment_id))

    async def _supervise(self, sup: InstanceSupervisor) -> None:
        while True:
            try:
                await sup.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                raise_if_cancelling()
                log.exception("%s: supervisor failed; resuming", sup.assignment_id)
                await self.ctx.clock.sleep(self.ctx.settings.restart_backoff)

    async def _remove(self, sup: InstanceSupervisor, task: asyncio.Task[None]) -> None:
        try:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            log.info("%s: assignment gone; removing its instance", sup.assignment_id)
            await sup.remove()
            await self.ctx.launcher.prune_images()
        finally:
            self._removing.pop(sup.assignment_id, None)
        self.ctx.launcher.retain_tenants(self.tenants())

    def tenants(self) -> set[str]:
        """The environments with something on this node: an assignment, or a volume's directory."""
        ctx = self.ctx
        found = {a.environment_id for a in ctx.view.assignments_by_node(ctx.node_id)}
        found |= {sup.assignment.environment_id for sup, _ in self._supervisors.values()}
        found |= {v.environment_id for v in ctx.view.volumes() if (ctx.volumes_dir / v.meta.id).exists()}
        return found

    async def recover(self) -> None:
        """Adopt or clean up what a previous run of this agent left in the instances directory."""
        ctx = self.ctx
        if not ctx.instances_dir.is_dir():
            return
        stops = []
        for directory in sorted(p for p in ctx.instances_dir.iterdir() if p.is_dir()):
            aid = directory.name
            record = InstanceRecord.load(directory)
            handle = await ctx.launcher.adopt(record, directory) if record else None
            a = ctx.view.assignment(aid)
            if a is not None and a.node_id != ctx.node_id:
                a = None
            release = ctx.view.release(a.release_id) if a is not None else None
            adoptable = a is not None and a.desired == RUN and release is not None and record is not None
            if handle is not None and record is not None and adoptable:
                assert a is not None and release is not None
                if record.config == config_of(a, release):
                    log.info("%s: adopting pid %d left by a previous run", aid, handle.pid)
                    self._launch(InstanceSupervisor(ctx, a, adopted=(handle, record)))
                    continue
            if handle is not None:
                default = ctx.settings.default_stop_grace
                grace = seconds(release.service.stop_grace, default) if release is not None else default
                log.info("%s: stopping pid %d left by a previous run", aid, handle.pid)
                stops.append(handle.stop(grace))
            if a is None:
                shutil.rmtree(directory, ignore_errors=True)
            else:
                (directory / STATE_FILE).unlink(missing_ok=True)
        await asyncio.gather(*stops)
        await ctx.launcher.sweep({sup.handle.container_id for sup, _ in self._supervisors.values() if sup.handle})
        ctx.launcher.retain_tenants(self.tenants())

    async def shutdown(self) -> None:
        entries = list(self._supervisors.values())
        tasks = [task for _, task in entries] + list(self._removing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.ctx.settings.stop_on_exit:
            await asyncio.gather(*(sup.stop_for_exit() for sup, _ in entries), return_exceptions=True)
        self._supervisors.clear()
