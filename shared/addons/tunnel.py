"""``zattera addons psql`` from any machine: a PostgreSQL session carried over NATS to the database's node
(docs/addons.md, "psql"; wire-contract.md, "Managed databases").

The operator's CLI listens on a Unix socket in a private temporary directory (0700) and runs the local
``psql`` on it; each connection psql opens there is one **session**: the CLI asks the database's node
``zattera.agent.<node>.psql`` (JSON ``{"session": S, "volume": <data volume id>}``), that node's agent
connects to the server's own Unix socket (``<volumes>/<id>/run/.s.PGSQL.<port>``, which trusts the
database's own local user: the superuser without a password, as the health check and pgBackRest connect),
and the bytes flow both ways as frames: agent → CLI as replies to the open request (its inbox), CLI → agent
on ``zattera.agent.<node>.psql.<S>``. No password exists anywhere on the way: not in an argument, a
variable, a log or an event. Who may ask is who may publish ``zattera.agent.*.psql`` (operators and the
control plane, SECURITY.md's role table).

A frame is one NATS message, its first byte its kind:

* ``O`` the session is open (agent → CLI, once); ``C`` the socket is there (answer to a ``check`` request);
* ``D`` + 8-byte sequence (big endian, from 1 per direction) + bytes: data;
* ``A`` + 8-byte count: the receiver consumed that many bytes in all (credit: a sender keeps at most
  :data:`WINDOW` bytes unacknowledged, so a slow reader never makes NATS drop a frame);
* ``K``: keep-alive, every :data:`KEEPALIVE` seconds each way; a side that hears nothing for
  :data:`IDLE` seconds ends the session;
* ``E`` + UTF-8 reason (empty: a clean end): the session ends (a lost frame — a sequence gap — ends it
  with a reason too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.ids import is_safe_id
from shared.subjects import agent_subject, is_direct_request

log = logging.getLogger(__name__)

VERB = "psql"
CHUNK = 32 * 1024
WINDOW = 1024 * 1024
ACK_EVERY = 128 * 1024
KEEPALIVE = 10.0
IDLE = 45.0
OPEN_TIMEOUT = 10.0
LOCAL_PORT = 5432


class TunnelError(ZatteraError):
    """The session could not be opened, or ended with a reason."""


def open_subject(node_id: str) -> str:
    return agent_subject(node_id, VERB)


def session_subject(node_id: str, session: str) -> str:
    return f"{agent_subject(node_id, VERB)}.{session}"


def server_socket(volumes_root: Path, volume_id: str) -> Path | None:
    """The PostgreSQL server's socket in its data volume (``run/.s.PGSQL.<port>``), None when not there."""
    if not is_safe_id(volume_id):
        return None
    run = volumes_root / volume_id / "run"
    for sock in sorted(run.glob(".s.PGSQL.*")) if run.is_dir() else ():
        if sock.name.rsplit(".", 1)[-1].isdigit():
            return sock
    return None


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


class Pump:
    """One session's two directions between a local stream and NATS frames (both sides use it)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        send: Callable[[bytes], Awaitable[None]],
        *,
        idle: float = IDLE,
        keepalive: float = KEEPALIVE,
    ) -> None:
        self.reader, self.writer, self.send = reader, writer, send
        self.inbound: asyncio.Queue[bytes] = asyncio.Queue()
        self.idle, self.keepalive = idle, keepalive
        self.reason = ""
        self._sent = self._acked = self._received = self._reported = 0
        self._seq_out = self._seq_in = 0
        self._credit = asyncio.Event()
        self._credit.set()

    def deliver(self, frame: bytes) -> None:
        """A frame from the other side. Credit is taken at once, not behind data waiting for the local
        reader: each direction's window must open even while the other one is stalled."""
        if frame[:1] == b"A":
            self._acked = max(self._acked, int.from_bytes(frame[1:9], "big"))
            self._credit.set()
        self.inbound.put_nowait(frame)

    async def run(self) -> str:
        """Until either side ends; the reason ("" for a clean end)."""
        tasks = [asyncio.create_task(self._up()), asyncio.create_task(self._down()), asyncio.create_task(self._beat())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                self.writer.close()
                await self.writer.wait_closed()
        return self.reason

    async def _up(self) -> None:
        """Local stream → frames, within the window."""
        while True:
            try:
                data = await self.reader.read(CHUNK)
            except OSError as exc:
                data, self.reason = b"", f"local read failed: {exc}"
            if not data:
                with contextlib.suppress(Exception):
                    await self.send(b"E" + self.reason.encode())
                return
            while self._sent - self._acked > WINDOW:
                self._credit.clear()
                await self._credit.wait()
            self._seq_out += 1
            self._sent += len(data)
            await self.send(b"D" + _u64(self._seq_out) + data)

    async def _down(self) -> None:
        """Frames → local stream; acknowledges what it wrote."""
        while True:
            try:
                frame = await asyncio.wait_for(self.inbound.get(), self.idle)
            except TimeoutError:
                self.reason = f"no word from the other side for {self.idle:.0f} s"
                return
            kind, body = frame[:1], frame[1:]
            if kind == b"D":
                seq = int.from_bytes(body[:8], "big")
                if seq != self._seq_in + 1:
                    self.reason = f"lost data (frame {seq} after {self._seq_in})"
                    with contextlib.suppress(Exception):
                        await self.send(b"E" + self.reason.encode())
                    return
                self._seq_in = seq
                self.writer.write(body[8:])
                await self.writer.drain()
                self._received += len(body) - 8
                if self._received - self._reported >= ACK_EVERY:
                    self._reported = self._received
                    await self.send(b"A" + _u64(self._received))
            elif kind == b"A":
                self._acked = max(self._acked, int.from_bytes(body[:8], "big"))
                self._credit.set()
            elif kind == b"E":
                self.reason = body.decode(errors="replace")
                return

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive)
            await self.send(b"K")


# --- the node's side ---------------------------------------------------------------------------------------


class TunnelAgent:
    """Serves ``zattera.agent.<node>.psql``: sessions to the PostgreSQL sockets of this node's volumes."""

    def __init__(self, conn: Connection, node_id: str, volumes_root: Path, *, idle: float = IDLE) -> None:
        self.conn, self.node_id, self.volumes_root, self.idle = conn, node_id, volumes_root, idle
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self.conn.nc.subscribe(open_subject(self.node_id), cb=self._on_open)
        await self.conn.nc.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_open(self, msg: Msg) -> None:
        if not is_direct_request(msg):
            log.warning("ignored a message on %s that is not a direct request", msg.subject)
            return
        task = asyncio.create_task(self._guarded(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, msg: Msg) -> None:
        try:
            await self._session(msg)
        except Exception as exc:
            log.warning("psql session on %s failed: %s: %s", msg.subject, type(exc).__name__, exc)
            with contextlib.suppress(Exception):
                await self.conn.nc.publish(msg.reply, f"Esession failed on node {self.node_id}".encode())

    async def _session(self, msg: Msg) -> None:
        nc, reply = self.conn.nc, msg.reply

        async def send(frame: bytes) -> None:
            await nc.publish(reply, frame)

        try:
            request = json.loads(msg.data)
            session, volume = str(request.get("session", "")), str(request.get("volume", ""))
        except (ValueError, AttributeError):
            await send(b"Ebad request")
            return
        if not is_safe_id(session) or not is_safe_id(volume):
            await send(b"Ebad request: session and volume must be plain ids")
            return
        sock = server_socket(self.volumes_root, volume)
        if sock is None:
            await send(f"Eno PostgreSQL server socket for volume {volume} on node {self.node_id}".encode())
            return
        if request.get("check"):
            await send(b"C")
            return
        try:
            reader, writer = await asyncio.open_unix_connection(str(sock))
        except OSError as exc:
            await send(f"Ecannot connect to the server on node {self.node_id}: {exc.strerror or exc}".encode())
            return
        pump = Pump(reader, writer, send, idle=self.idle)

        async def feed(frame: Msg) -> None:
            pump.deliver(frame.data)

        sub = await nc.subscribe(session_subject(self.node_id, session), cb=feed)
        try:
            await send(b"O")
            log.info("psql session %s to volume %s opened", session, volume)
            reason = await pump.run()
            log.info("psql session %s ended%s", session, f": {reason}" if reason else "")
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def serve_psql_sessions(conn: Connection, node_id: str, volumes_root: Path) -> None:
    """Serve this node's psql sessions until cancelled."""
    agent = TunnelAgent(conn, node_id, volumes_root)
    await agent.start()
    try:
        await asyncio.Event().wait()
    finally:
        await agent.stop()


# --- the operator's side -----------------------------------------------------------------------------------


class _Inbound(asyncio.Queue[bytes]):
    """A session's replies: queued until its pump takes them (then handed to it as they come)."""

    pump: Pump | None = None


async def _open(
    conn: Connection, node_id: str, volume_id: str, *, check: bool = False
) -> tuple[str, Subscription, _Inbound]:
    """A session's id, the subscription to its replies and their queue, once the agent said it is open."""
    nc = conn.nc
    session = secrets.token_hex(16)
    inbox = nc.new_inbox()
    frames = _Inbound()

    async def collect(msg: Msg) -> None:
        # An empty message is the server's "no responders" status: no agent of that node listens.
        frame = msg.data or f"Eno agent answers for node {node_id} (is it up?)".encode()
        if frames.pump is not None:
            frames.pump.deliver(frame)
        else:
            frames.put_nowait(frame)

    sub = await nc.subscribe(inbox, cb=collect)
    body = {"session": session, "volume": volume_id, **({"check": True} if check else {})}
    await nc.publish(open_subject(node_id), json.dumps(body).encode(), reply=inbox)
    try:
        first = await asyncio.wait_for(frames.get(), OPEN_TIMEOUT)
    except TimeoutError:
        await sub.unsubscribe()
        raise TunnelError(f"no answer from node {node_id}'s agent in {OPEN_TIMEOUT:.0f} s") from None
    if first[:1] == b"E":
        await sub.unsubscribe()
        raise TunnelError(first[1:].decode(errors="replace"))
    return session, sub, frames


async def check_reachable(conn: Connection, node_id: str, volume_id: str) -> None:
    """Raise :class:`TunnelError` unless ``node_id``'s agent sees the server's socket."""
    _session, sub, _frames = await _open(conn, node_id, volume_id, check=True)
    await sub.unsubscribe()


async def carry(
    conn: Connection, node_id: str, volume_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> str:
    """One local connection carried to the server; the end's reason."""
    try:
        session, sub, frames = await _open(conn, node_id, volume_id)
    except TunnelError as exc:
        writer.close()
        return str(exc)
    subject = session_subject(node_id, session)

    async def send(frame: bytes) -> None:
        await conn.nc.publish(subject, frame)

    pump = Pump(reader, writer, send)
    pump.inbound = frames
    frames.pump = pump
    try:
        return await pump.run()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def psql_binary(version: str) -> str:
    """This machine's psql: the server version's own client, else the one on PATH."""
    own = Path(f"/usr/lib/postgresql/{version}/bin/psql")
    found = str(own) if own.exists() else shutil.which("psql")
    if not found:
        raise TunnelError("psql is not installed on this machine (Debian: apt-get install postgresql-client)")
    return found


async def run_psql(
    conn: Connection,
    node_id: str,
    volume_id: str,
    args: Sequence[str],
    *,
    psql: str,
    stdout: IO[bytes] | int | None = None,
    on_error: Callable[[str], None] | None = None,
) -> int:
    """Run ``psql args…`` (as the superuser ``postgres``) on a private local socket carried to the database
    on ``node_id``; psql's exit code. Ctrl-C goes to psql (it cancels the running query), not to us."""
    await check_reachable(conn, node_id, volume_id)
    directory = Path(tempfile.mkdtemp(prefix="zattera-psql-"))  # 0700: only this user reaches the socket
    sessions: set[asyncio.Task[None]] = set()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        sessions.add(task)
        try:
            reason = await carry(conn, node_id, volume_id, reader, writer)
            if reason and on_error is not None:
                on_error(reason)
        except asyncio.CancelledError:
            pass  # psql exited: the session ends with it (a cancelled callback task would be logged)
        finally:
            sessions.discard(task)

    loop = asyncio.get_running_loop()
    server = await asyncio.start_unix_server(accepted, path=str(directory / f".s.PGSQL.{LOCAL_PORT}"))
    interrupt = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # psql's own; reset for the child at exec
        interrupt = True
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        proc = await asyncio.create_subprocess_exec(
            psql, "-h", str(directory), "-p", str(LOCAL_PORT), "-U", "postgres", *args, stdout=stdout, env=env
        )
        code = await proc.wait()
        if sessions:  # psql closed its connections: let their ends reach the node
            await asyncio.wait(list(sessions), timeout=2)
        return code
    finally:
        if interrupt:
            loop.remove_signal_handler(signal.SIGINT)
        server.close()
        for task in list(sessions):
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
        shutil.rmtree(directory, ignore_errors=True)
