"""Node join, the joining side: ask the join service for a token (operator), and exchange a token for a
node credential as the ``JOIN`` account's sentinel (an agent, ``zattera up --join``).

The token's format and the service that issues and checks tokens are :mod:`shared.security.join`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

import nats
import nats.errors

from shared.connection import Connection, split_urls
from shared.security.creds import creds_text
from shared.security.join import JoinRefused, JoinToken, JoinUnavailable
from shared.security.nkeyjwt import KeyKind, KeyPair
from shared.security.permissions import JOIN_ISSUE_SUBJECT, JOIN_SUBJECT


async def request_join_token(
    conn: Connection,
    *,
    ttl: float,
    node_id: str = "",
    builder: bool = False,
    server_secret: str = "",
    server_bundle: str = "",
) -> str:
    """Ask the join service for a token (operator role): a machine token (``zjt2``, for ``zattera up
    --join``) where the service knows the cluster's servers, else an agent's ``zjt1``. ``server_*``: a
    server machine's token, its secret and sealed bundle made by the caller (:mod:`shared.security.machines`).
    Raises :class:`JoinRefused` with its reason."""
    request: dict[str, Any] = {"ttl": ttl, "node_id": node_id, "builder": builder}
    if server_secret:
        request |= {"server": True, "secret": server_secret, "bundle": server_bundle}
    try:
        msg = await conn.nc.request(JOIN_ISSUE_SUBJECT, json.dumps(request).encode(), timeout=10)
    except nats.errors.NoRespondersError:
        raise JoinRefused("no join service is running (zattera up --secure starts one)") from None
    reply = json.loads(msg.data)
    if "error" in reply:
        raise JoinRefused(reply["error"])
    return str(reply.get("machine_token") or reply["token"])


async def join(
    urls: str | list[str], token: str, node_id: str, *, tls_ca: str | None = None, timeout: float = 10.0
) -> str:
    """Exchange ``token`` for this node's credentials (``.creds`` text, to be stored 0600).

    Raises :class:`JoinRefused` when the token is malformed, unknown, used, expired or bound to another node,
    :class:`JoinUnavailable` (a subclass) when nobody answered: NATS unreachable, no join service, a timeout.
    """
    user = KeyPair.generate(KeyKind.USER)
    reply = await exchange(
        urls, token, {"node_id": node_id, "public_key": user.public_key}, tls_ca=tls_ca, timeout=timeout
    )
    return creds_text(str(reply["jwt"]), user.seed)


async def _quiet(_exc: Exception) -> None:
    return None


async def exchange(
    urls: str | list[str],
    token: str,
    request: dict[str, Any],
    *,
    tls_ca: str | None = None,
    timeout: float = 10.0,
    retry_connect: bool = False,
) -> dict[str, Any]:
    """Send ``request`` with the token's secret to the join service as the join sentinel; its answer.
    Raises :class:`JoinRefused` (its reason) or :class:`JoinUnavailable` (nobody answered)."""
    parsed = JoinToken.parse(token)
    node_id = str(request.get("node_id") or "")

    def sentinel() -> bytes:
        return parsed.sentinel_jwt.encode()

    def no_signature(_nonce: str) -> bytes:
        return b""  # the sentinel is a bearer JWT: the server does not ask for proof of a key

    tls = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers=split_urls(urls),
                name=f"zattera-join-{node_id}",
                user_jwt_cb=sentinel,
                signature_cb=no_signature,
                tls=tls,
                allow_reconnect=retry_connect,
                max_reconnect_attempts=0,
                error_cb=_quiet,  # the failure is raised below, in one line (nats-py would print a traceback)
                connect_timeout=max(1, int(timeout)),
            ),
            timeout * 2,
        )
    except (nats.errors.AuthorizationError, nats.errors.InvalidUserCredentialsError) as exc:
        raise JoinRefused(f"the NATS server refused the join credential: {exc}") from exc
    except ssl.SSLCertVerificationError as exc:
        raise JoinRefused(
            f"the servers at {urls} are not the cluster's (their certificate: {exc.verify_message})"
        ) from exc
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        if "authorization" in str(exc).lower():
            raise JoinRefused(f"the NATS server refused the join credential: {exc}") from exc
        raise JoinUnavailable(f"cannot reach NATS at {urls}: {exc or type(exc).__name__}") from exc
    try:
        body = {**request, "secret": parsed.secret}
        try:
            msg = await nc.request(JOIN_SUBJECT, json.dumps(body).encode(), timeout=timeout)
        except nats.errors.NoRespondersError:
            raise JoinUnavailable("no join service is answering on this cluster") from None
        except (nats.errors.TimeoutError, TimeoutError):
            raise JoinUnavailable(f"the join service did not answer within {timeout:.0f}s") from None
    finally:
        await nc.close()
    reply: dict[str, Any] = json.loads(msg.data)
    if "error" in reply:
        raise JoinRefused(reply["error"])
    return reply
