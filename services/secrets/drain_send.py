"""What a log drain sends and how: the records a stream message carries for a drain, and one drain's
connection to its receiver (an HTTP POST per batch, or syslog frames over one TLS connection).

A drain's URL, headers and CA are sealed to the cluster secrets key: :func:`open_target` opens them, and a
failed delivery is a :class:`Delivery` whose message names no credential.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
from dataclasses import dataclass, field

import aiohttp
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from zattera.v1 import types_pb2 as pb

from shared import drains
from shared.actions.names import env_label
from shared.backup.sealed import open_settings
from shared.errors import ZatteraError
from shared.secrets import Keyring
from shared.state.reader import StateReader


@dataclass
class DrainTarget:
    """A drain's receiver, its sealed settings opened."""

    endpoint: drains.Endpoint = field(repr=False)
    ca: str = field(repr=False)
    secrets: tuple[str, ...] = field(repr=False)
    """Every credential, to scrub from error messages."""


def open_target(keyring: Keyring | None, drain: pb.LogDrain) -> DrainTarget:
    """The drain's receiver, opened from its sealed settings with the cluster secrets key."""
    opened = open_settings(keyring, drain.sealed, drain.key_id)
    headers = json.loads(opened.get("headers") or "{}")
    url = opened["url"]
    e = drains.endpoint(url, headers)
    secrets = [url, *headers.values()]
    if e.basic_auth:
        secrets += [e.basic_auth[1]]
    return DrainTarget(e, opened.get("ca", ""), tuple(secrets))


def records_of(view: StateReader, drain: pb.LogDrain, envs: list[str], env_id: str, msg: Msg) -> list[drains.Record]:
    """The records message ``msg`` carries for ``drain``: an app log batch's lines (``env_id`` its env), or an
    event of the drain's environments ("" ``env_id``: the events stream)."""
    if env_id:
        return drains.records_of_batch(msg.data, env_label(view, env_id))
    try:
        event = pb.Event.FromString(msg.data)
    except DecodeError:
        return []
    ours = event.environment_id in envs if drain.environment_id else event.project_id == drain.project_id
    if not ours:
        return []
    label = env_label(view, event.environment_id) if event.environment_id else ""
    return [drains.record_of_event(event, label)]


class Delivery(ZatteraError):
    """A delivery the receiver did not accept; the message names no credential."""


class Sender:
    """One drain's connection to its receiver."""

    def __init__(self, target: DrainTarget, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        e = target.endpoint
        self._ssl: ssl.SSLContext | None = None
        if e.tls:
            self._ssl = ssl.create_default_context(cadata=target.ca or None)
        self._session: aiohttp.ClientSession | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None

    async def send(self, payload: bytes) -> None:
        try:
            if self.target.endpoint.scheme == drains.SYSLOG_TLS:
                await asyncio.wait_for(self._send_syslog(payload), self.timeout)
            else:
                await self._post(payload)
        except Delivery:
            raise
        except TimeoutError:
            await self.close()
            raise Delivery(f"no answer within {self.timeout:.0f}s") from None
        except (aiohttp.ClientConnectorCertificateError, ssl.SSLCertVerificationError):
            await self.close()
            raise Delivery("TLS failed (the receiver's certificate is not trusted; --ca-file?)") from None
        except ssl.SSLError as exc:
            await self.close()
            raise Delivery(f"TLS failed ({getattr(exc, 'reason', None) or type(exc).__name__})") from None
        except (aiohttp.ClientError, OSError) as exc:
            await self.close()
            raise Delivery(f"cannot reach the receiver ({type(exc).__name__})") from None
        except Exception as exc:  # anything else is this delivery's failure too: said, retried, counted
            await self.close()
            raise Delivery(f"the delivery failed ({type(exc).__name__})") from None

    async def _send_syslog(self, payload: bytes) -> None:
        e = self.target.endpoint
        if self._writer is not None and (self._writer.is_closing() or (self._reader and self._reader.at_eof())):
            await self.close()  # the receiver closed the connection: frames written now would be lost
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                e.host, e.port, ssl=self._ssl, server_hostname=e.host
            )
        self._writer.write(payload)
        await self._writer.drain()

    async def _post(self, payload: bytes) -> None:
        e = self.target.endpoint
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        headers = {"Content-Type": drains.content_type(e.scheme), "User-Agent": "zattera-drain/1", **e.headers}
        if e.basic_auth:
            user, password = e.basic_auth
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        async with self._session.post(
            e.url, data=payload, headers=headers, ssl=self._ssl or True, allow_redirects=False
        ) as resp:
            await resp.read()
            if not 200 <= resp.status < 300:
                raise Delivery(f"the receiver answered {resp.status} {resp.reason or ''}".rstrip())

    async def close(self) -> None:
        if self._writer is not None:
            writer, self._writer, self._reader = self._writer, None, None
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2.0)
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
