"""HAProxy in the data path, run and driven by the proxy process (``--engine haproxy``).

:class:`HAProxyEngine` supervises one HAProxy in master-worker mode (``haproxy -W -S master.sock``):
started from a configuration rendered from the current routes, restarted (with the routes it has now,
so from the route cache when the control plane is down) whenever it exits without being asked to, and
soft-stopped on shutdown (in-flight requests finish). It outlives a crash of the proxy process, serving
the last routes; the next proxy process adopts it and reloads it with its own snapshot
(:mod:`services.proxy.haproxy_process`: the process side, spawn, adopt, stop, the pid file).

Route changes (:meth:`HAProxyEngine.apply`, serialized, the newest snapshot wins) go through the runtime
API when they can, so nothing is dropped and nothing is re-parsed: Host map entries, the path map, and
servers of non-sticky backends. A server that leaves is put in maintenance at once (no new requests;
the ones in flight finish) and deleted once HAProxy accepts it (no connection left). Anything else is a
structure change (:mod:`services.proxy.haproxy_plan`): the configuration is rewritten and the master
told to ``reload``; the new worker takes the listening sockets over (``expose-fd listeners``), the old one
finishes its in-flight requests and WebSockets (bounded by ``hard-stop-after``).

The runtime commands are computed by :mod:`services.proxy.haproxy_changes` and sent by the runtime API client
(:mod:`services.proxy.haproxy_runtime`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.haproxy_certs import (
    changed_names,
    changes,
    crt_list_text,
    digest,
    ensure_fallback,
    installed,
    safe_name,
    usable_pems,
)
from services.proxy.haproxy_changes import RUNTIME_SERVER_IDS, hosts_map_commands, map_rewrite_commands, server_commands
from services.proxy.haproxy_config import Layout, Plan, map_text, render
from services.proxy.haproxy_latency import LatencyLog, LogEvery
from services.proxy.haproxy_plan import RouteCache, plan
from services.proxy.haproxy_process import Master, adopt, private_dir, spawn
from services.proxy.haproxy_runtime import (
    RuntimeAPIError,
    command,
    execute,
    parse_stat_csv,
    prepare_map,
    refused,
    send,
    worker_pid,
)
from services.proxy.haproxy_stats import HAProxySampler, ServerTraffic
from services.proxy.launch import HAPROXY, haproxy_binary
from shared.backoff import Backoff
from shared.files import PRIVATE, write_atomic
from shared.metrics import RequestSeries

log = logging.getLogger(__name__)


READY_TIMEOUT = 30.0


RESTART_BACKOFF_FIRST = 0.1


RESTART_BACKOFF_MAX = 5.0


SWEEP_INTERVAL = 1.0


CERT_CHUNK = 500
"""Certificates checked, written and loaded together (:meth:`HAProxyEngine.set_certificates`)."""


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning 10,000 routes allocates enough to trigger full collections of the cached plan: 20-40 ms
    became 250-500 ms, on the route change path. The loop creates no cycles, so none is missed."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class HAProxyEngine:
    def __init__(
        self, layout: Layout, *, node_id: str, binary: str | None = None, requests: RequestSeries | None = None
    ) -> None:
        self.layout = layout
        self.requests = requests
        """Where HAProxy's answered requests are counted (``zattera.proxy.request.duration``), if metrics are on."""
        self.node_id = node_id
        self.binary = binary or haproxy_binary() or HAPROXY
        self.running = Plan({}, (), {})
        """What HAProxy serves now (configuration plus runtime changes)."""
        self.restarts = 0
        self.reloads = 0
        self._snapshot = cpb.RouteSnapshot()
        self._route_cache: RouteCache = {}
        self._lock = asyncio.Lock()
        self._draining: set[tuple[str, str]] = set()
        self._old_workers: set[int] = set()
        """Pids of workers replaced by a reload: each keeps its connections (WebSockets) until they end."""
        self._server_ids = itertools.count(RUNTIME_SERVER_IDS)
        """Ids of the servers added at run time (see :data:`RUNTIME_SERVER_IDS`)."""
        self._master: Master | None = None
        self._stopping = False
        self._started = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sampler = HAProxySampler(time.time())
        self.server_traffic = ServerTraffic()
        """Weighted (canary) routes' per-release counters (issue 41), refreshed by :meth:`samples`."""
        self.latency_log = LatencyLog(layout.latency_socket, lambda: self.running) if layout.latency_log else None
        """HAProxy's request log: real latency percentiles per env and histograms per canary release."""
        self.log_every = LogEvery(layout.log_every_map, layout.latency_log_lines)
        """Which busy backends log one request in N (``Layout.log_every_map``)."""
        self._certificates: dict[str, str] = {}
        """name → digest of the certificates HAProxy holds."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        """The HAProxy master's."""
        return self._master.pid if self._master is not None else None

    @property
    def adopted(self) -> bool:
        """Whether the HAProxy served is one a previous proxy process left running (not our child)."""
        return self._master is not None and self._master.adopted

    async def start(self, snapshot: cpb.RouteSnapshot) -> None:
        """Serve ``snapshot`` (the cached routes at process start) with the HAProxy a crashed proxy process
        left running, else a new one; returns once HAProxy answers."""
        self.layout.directory.mkdir(parents=True, exist_ok=True)
        private_dir(self.layout.socket_dir)
        self._snapshot = snapshot
        if self.latency_log is not None:
            await self.latency_log.start()
        async with self._lock:
            if not await self._adopt():
                await self._spawn()
        self._tasks = [asyncio.create_task(self._supervise()), asyncio.create_task(self._sweep())]

    async def stop(self) -> None:
        """Soft stop: the listeners close, in-flight requests finish within the shutdown grace; nothing is
        left running (only a crash of the proxy process leaves HAProxy, for the next one to adopt)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._master is not None:
            await self._master.stop(self.layout.shutdown_grace + 1)
            self.layout.pid_file.unlink(missing_ok=True)
        if self.latency_log is not None:
            await self.latency_log.close()
        if self.layout.socket_dir != self.layout.directory:
            shutil.rmtree(self.layout.socket_dir, ignore_errors=True)

    def _write_files(self, target: Plan) -> None:
        """HAProxy's files, derived from the routes and certificates and written again at every start:
        whole, but not synced (a sync per route change would cost more than a lost write)."""
        if self.layout.tls_bind:
            ensure_fallback(self.layout.default_cert)
            write_atomic(self.layout.crt_list, crt_list_text(self.layout.certs_dir), durable=False)
        write_atomic(self.layout.hosts_map, map_text(sorted(target.hosts.items())), durable=False)
        write_atomic(self.layout.paths_map, map_text(target.paths), durable=False)
        write_atomic(self.layout.log_every_map, map_text(self.log_every.entries()), durable=False)
        write_atomic(self.layout.config_file, render(target, self.layout), durable=False)

    async def _spawn(self) -> None:
        target = self._plan(self._snapshot)
        self._write_files(target)
        self._master = master = await spawn(self.layout, self.binary)
        await self._wait_ready(None)
        self.running = target
        self._certificates = installed(self.layout.certs_dir)
        self._draining.clear()
        self._old_workers.clear()
        log.info("haproxy: pid %d serving %d hosts, %d backends", master.pid, len(target.hosts), len(target.backends))

    async def _adopt(self) -> bool:
        """Serve the current snapshot with the HAProxy a crashed proxy process left (a whole configuration
        and a ``reload``: the listening sockets are kept, no connection is refused); False when there is
        none to adopt, or it does not take the reload (then it is stopped)."""
        master = await adopt(self.layout, self.binary)
        if master is None:
            return False
        self._master = master
        self._old_workers = set(master.old_workers)
        target = self._plan(self._snapshot)
        try:
            await self._reload(target)
        except (OSError, RuntimeError, TimeoutError, RuntimeAPIError) as exc:
            log.error("haproxy: adopted pid %d did not reload (%s); starting a new one", master.pid, exc)
            await master.stop(self.layout.shutdown_grace + 1)
            self._master = None
            return False
        self._certificates = installed(self.layout.certs_dir)
        log.info(
            "haproxy: adopted pid %d (left running by a previous proxy process), serving %d hosts, %d backends",
            master.pid,
            len(target.hosts),
            len(target.backends),
        )
        return True

    async def _wait_ready(self, old_worker: int | None) -> None:
        """Until a worker other than ``old_worker`` answers on the stats socket."""
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            master = self._master
            if master is not None and master.exited:
                raise RuntimeError(f"haproxy exited with {master.returncode}; see {self.layout.directory}/haproxy.log")
            pid = await worker_pid(self.layout.stats_socket)
            if pid is not None and pid != old_worker:
                return
            await asyncio.sleep(0.02)
        raise TimeoutError(f"haproxy did not answer within {READY_TIMEOUT:.0f}s")

    async def _supervise(self) -> None:
        """Restart HAProxy whenever it exits on its own, with the current routes."""
        backoff = Backoff(RESTART_BACKOFF_FIRST, RESTART_BACKOFF_MAX)
        while True:
            master = self._master
            assert master is not None
            code = await master.wait()
            master.close()
            if self._stopping:
                return
            log.error("haproxy exited (%s); restarting with routes version %d", code, self._snapshot.version)
            async with self._lock:
                try:
                    await self._spawn()
                    self.restarts += 1
                    backoff.reset()
                except (OSError, RuntimeError, TimeoutError) as exc:
                    delay = next(backoff)
                    log.error("haproxy restart failed: %s; retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)

    # ------------------------------------------------------------------ route changes

    def _plan(self, snapshot: cpb.RouteSnapshot) -> Plan:
        with _gc_paused():
            return plan(snapshot, node_id=self.node_id, hold_timeout=self.layout.hold_timeout, cache=self._route_cache)

    async def apply(self, snapshot: cpb.RouteSnapshot) -> None:
        """Make HAProxy serve ``snapshot``: runtime changes, or a reload for a structure change."""
        self._snapshot = snapshot
        async with self._lock:
            if snapshot is not self._snapshot:
                return  # a newer one came meanwhile: the call that brought it applies it
            target = self._plan(snapshot)
            started = time.monotonic()
            if not target.same_structure(self.running):
                await self._reload(target)
                log.info(
                    "haproxy: reloaded for routes version %d (%d backends) in %.2fs",
                    snapshot.version,
                    len(target.backends),
                    time.monotonic() - started,
                )
            else:
                await self._change_at_runtime(target)
                log.debug("haproxy: routes version %d applied in %.3fs", snapshot.version, time.monotonic() - started)

    async def _reload(self, target: Plan) -> None:
        old_worker = await worker_pid(self.layout.stats_socket)
        self._write_files(target)
        await send(self.layout.master_socket, "reload")  # the master re-executes: no answer comes
        await self._wait_ready(old_worker)
        self.running = target
        self._draining.clear()
        if old_worker is not None:
            self._old_workers.add(old_worker)
        self.reloads += 1

    async def _change_at_runtime(self, target: Plan) -> None:
        """Servers that arrive first, then the maps, then servers that leave: a host never points at a
        backend whose servers are not in yet, nor at one whose servers already left (a request in between
        found no server: 503)."""
        running = self.running
        commands, leaving = server_commands(running, target, self._draining, self._server_ids)
        hosts = hosts_map_commands(self.layout.hosts_map, running, target)
        if hosts is None:
            hosts = await self._rewrite_map_commands(self.layout.hosts_map, sorted(target.hosts.items()))
        commands += hosts
        if target.paths != running.paths:
            commands += await self._rewrite_map_commands(self.layout.paths_map, target.paths)
        commands += leaving
        if commands:
            answers = await execute(self.layout.stats_socket, commands)
            failures = [f"{c!r}: {a}" for c, a in zip(commands, answers, strict=True) if refused(a)]
            if failures:
                log.warning("haproxy runtime changes refused (%d): %s", len(failures), "; ".join(failures[:3]))
        self.running = target
        await self._delete_drained()

    async def _rewrite_map_commands(self, path: Path, entries: Iterable[tuple[str, str]]) -> list[str]:
        """An atomic rewrite of a map: a new version filled, then committed (:func:`map_rewrite_commands`)."""
        return map_rewrite_commands(await prepare_map(self.layout.stats_socket, path), path, entries)

    async def _delete_drained(self) -> None:
        if not self._draining:
            return
        pending = sorted(self._draining)
        answers = await execute(self.layout.stats_socket, [f"del server {b}/{s}" for b, s in pending])
        for key, answer in zip(pending, answers, strict=True):
            if "deleted" in answer.lower() or "no such" in answer.lower():
                self._draining.discard(key)

    async def _sweep(self) -> None:
        """Delete servers left in maintenance once their last connection is gone."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            async with self._lock:
                with contextlib.suppress(OSError, TimeoutError, RuntimeAPIError):
                    await self._delete_drained()

    # ------------------------------------------------------------------ certificates

    @property
    def certificates(self) -> Mapping[str, str]:
        """name → digest of the certificates HAProxy serves."""
        return self._certificates

    async def set_certificates(self, pems: Mapping[str, str]) -> None:
        """Serve exactly ``pems`` (name → PEM of chain + key) on the TLS listener: new and changed ones are
        loaded and swapped in through the runtime API (open connections keep theirs, new handshakes get
        the new one), missing ones removed. Files are written first, so a restart or reload loads them.

        The event loop is never held: checking the PEMs, computing the changes and writing the files run
        in threads (10,000 certificates held the proxy's loop — its NATS client, heartbeats, route changes
        — for ~24 s). They go in chunks of :data:`CERT_CHUNK`, the next chunk checked while HAProxy loads
        this one, and the engine's lock is taken per chunk, so route changes are applied in between."""
        names = await asyncio.to_thread(changed_names, pems, dict(self._certificates))
        chunks = [names[i : i + CERT_CHUNK] for i in range(0, len(names), CERT_CHUNK)]
        changed = set(names)
        usable = {name: pem for name, pem in pems.items() if name not in changed}  # served as they are
        checking: asyncio.Future[dict[str, str]] | None = None
        try:
            for index, chunk in enumerate(chunks):
                if checking is None:
                    checking = self._check({name: pems[name] for name in chunk})
                checked = await checking
                checking = None
                if index + 1 < len(chunks):
                    checking = self._check({name: pems[name] for name in chunks[index + 1]})
                async with self._lock:
                    await self._install_certificates(checked, only_these=True)
                usable.update(checked)
        finally:
            if checking is not None:
                await asyncio.gather(checking, return_exceptions=True)
        async with self._lock:
            await self._install_certificates(usable, only_these=False)  # removes those no longer wanted

    def _check(self, pems: Mapping[str, str]) -> asyncio.Future[dict[str, str]]:
        """``pems`` without those HAProxy would refuse, in a thread."""
        return asyncio.ensure_future(
            asyncio.to_thread(usable_pems, pems, dict(self._certificates), self.layout.socket_dir)
        )

    async def _install_certificates(self, pems: Mapping[str, str], *, only_these: bool) -> None:
        """Install ``pems`` (checked) at run time; unless ``only_these``, remove every other certificate."""
        wanted = {safe_name(name) for name in pems}
        have = {k: v for k, v in self._certificates.items() if k in wanted} if only_these else dict(self._certificates)
        commands, to_write, gone = await asyncio.to_thread(
            changes, pems, have, self.layout.certs_dir, self.layout.crt_list
        )
        if not commands:
            return
        listed = bool(gone) or not to_write.keys() <= have.keys()  # the crt-list changes: names come or go
        writing = asyncio.ensure_future(asyncio.to_thread(self._write_certificates, to_write, gone, listed))
        try:
            answers = await execute(self.layout.stats_socket, commands)
        finally:
            digests = await writing
        failures = [c.split(" <<", 1)[0] + f": {a}" for c, a in zip(commands, answers, strict=True) if refused(a)]
        if failures:
            log.warning("haproxy certificate changes refused (%d): %s", len(failures), "; ".join(failures[:3]))
        self._certificates.update(digests)
        for name in gone:
            self._certificates.pop(name, None)

    def _write_certificates(self, to_write: Mapping[str, str], gone: Iterable[str], listed: bool) -> dict[str, str]:
        """(In a thread.) The certificate files and (``listed``) the crt-list; name → digest of those written.
        The runtime API does not read them: HAProxy gets each PEM in its ``set ssl cert``."""
        digests = {}
        for name, pem in to_write.items():
            write_atomic(self.layout.certs_dir / f"{name}.pem", pem, mode=PRIVATE, durable=False)
            digests[name] = digest(pem)
        for name in gone:
            (self.layout.certs_dir / f"{name}.pem").unlink(missing_ok=True)
        if listed:
            write_atomic(self.layout.crt_list, crt_list_text(self.layout.certs_dir), durable=False)
        return digests

    # ------------------------------------------------------------------ stats

    async def old_inflight(self) -> tuple[dict[str, int], bool]:
        """Env id → servers that left its backend (an old release after a promotion) and still hold
        connections (HAProxy refuses to delete them until their last one ends), and whether that is all
        HAProxy has in flight: False while a worker from before a reload still runs (it keeps its
        connections, WebSockets, unseen by this worker's counts) or when HAProxy does not answer."""
        try:
            async with self._lock:
                await self._delete_drained()
                held = sorted(self._draining)
        except (OSError, TimeoutError, RuntimeAPIError):
            return {}, False
        counts: dict[str, int] = {}
        for backend_name, _ in held:
            env_id = self.running.env_of_backend.get(backend_name, "")
            counts[env_id] = counts.get(env_id, 0) + 1
        self._old_workers = {pid for pid in self._old_workers if _alive(pid)}
        return counts, not self._old_workers

    async def samples(self) -> dict[str, cpb.ProxySample]:
        """Per-env samples since the previous call; empty when HAProxy does not answer (restarting)."""
        try:
            text = await command(self.layout.stats_socket, "show stat -1 3 -1", timeout=2)  # frontends, backends
        except (OSError, TimeoutError, RuntimeAPIError):
            return {}
        latencies = None
        if self.latency_log is not None:
            await self.latency_log.ensure()
            latencies = self.latency_log.percentiles(set(self.running.env_of_backend.values()))
        samples = self._sampler.sample(parse_stat_csv(text), self.running.env_of_backend, time.time(), latencies)
        weighted = await self._sample_weighted_servers()
        if self.latency_log is not None:  # busy backends log one request in N
            with contextlib.suppress(OSError, TimeoutError, RuntimeAPIError):  # the rest at the next sample
                send = partial(command, self.layout.stats_socket)
                await self.log_every.update(self._sampler.backend_rates, weighted, send)
        if self.requests is not None:
            for answered in self._sampler.responses:
                for _ in range(answered.count):
                    self.requests.observe(answered.env_id, answered.status_class * 100, answered.seconds)
        return samples

    async def _sample_weighted_servers(self) -> set[str]:
        """Samples the weighted backends' server rows (none without a canary) and returns those backends' names."""
        owners: dict[tuple[str, str], tuple[str, str, str]] = {}
        for backend in self.running.backends.values():
            for server in backend.servers:
                if server.step_tag:
                    owners[(backend.name, server.name)] = (backend.env_id, server.release_id, server.step_tag)
        weighted = {name for name, _ in owners}
        rows: list[dict[str, str]] = []
        for backend_name in sorted(weighted):
            try:
                rows += parse_stat_csv(await command(self.layout.stats_socket, f"show stat {backend_name} 4 -1"))
            except (OSError, TimeoutError, RuntimeAPIError):
                return weighted
        self.server_traffic.sample(
            rows, owners, self.latency_log.latencies.releases if self.latency_log is not None else None
        )
        return weighted

    def release_traffic(self) -> list[cpb.ReleaseTraffic]:
        return list(self.server_traffic.report)


def _alive(pid: int) -> bool:
    """Whether a process runs (an old HAProxy worker: the master, our child, reaps it when it exits)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
