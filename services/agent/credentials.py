"""The agent's NATS credential on a secured cluster (SECURITY.md, "Node join").

Which credential an agent connects with, first match wins:

1. ``<data dir>/node.creds``: the node's own credential, stored by an earlier join. A join token given
   again (the same, now used one, or any other) is then ignored: the node has joined. To re-join (after a
   revocation), delete the file and start with a token bound to the node (``zattera nodes join-token
   --node <id>``).
2. ``--join-token`` / ``ZATTERA_AGENT_JOIN_TOKEN``: exchanged once with :func:`shared.security.join_client.join`
   for a credential, stored 0600 as ``node.creds`` before the agent first connects with it. While nobody
   answers (NATS down, join service not started yet) the exchange is retried; a refusal (used, expired,
   unknown, bound to another node) stops the agent with the service's reason.
3. ``ZATTERA_NATS_CREDS``: a credential issued by other means (``zattera up --secure`` gives its local
   agent one, ``zattera security creds agent <id>``).
4. None: an unsecured cluster, as in development.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from shared.errors import ZatteraError
from shared.process import retry_until_stopped
from shared.security.creds import read_user_jwt, write_private
from shared.security.join import JoinUnavailable
from shared.security.join_client import join
from shared.security.nkeyjwt import decode_claims

log = logging.getLogger(__name__)

CREDS_FILE = "node.creds"


class CredentialError(ZatteraError):
    """The agent cannot get a usable credential (join refused, stored credential for another node)."""


def stored_creds(data_dir: Path) -> Path:
    return data_dir / CREDS_FILE


def creds_name(path: Path) -> str:
    """The user name a credential was issued for (a node credential's name is its node id)."""
    return str(decode_claims(read_user_jwt(path)).get("name") or "")


async def node_credentials(
    urls: str,
    node_id: str,
    data_dir: Path,
    *,
    join_token: str = "",
    env_creds: str = "",
    tls_ca: str = "",
    stop: asyncio.Event,
) -> str | None:
    """The credentials file to connect with, or None (unauthenticated); see the module docstring.

    Returns None as well when ``stop`` is set while waiting for the join service.
    """
    path = stored_creds(data_dir)
    if path.exists():
        name = creds_name(path)
        if name != node_id:
            raise CredentialError(f"{path} holds the credential of node {name!r}, not {node_id!r}")
        if join_token:
            log.info("node %s already joined (credential %s): the join token is not used", node_id, path)
        return str(path)
    if join_token:
        text = await _join_with_retry(urls, join_token, node_id, tls_ca=tls_ca, stop=stop)
        if text is None:
            return None
        write_private(path, text)
        log.info("node %s joined the cluster; credential stored in %s", node_id, path)
        return str(path)
    return env_creds or None


async def _join_with_retry(urls: str, token: str, node_id: str, *, tls_ca: str, stop: asyncio.Event) -> str | None:
    return await retry_until_stopped(
        stop,
        lambda: join(urls, token, node_id, tls_ca=tls_ca or None),
        what=f"node {node_id}: join not answered",
        retry_on=(JoinUnavailable,),
        first=0.5,
        last=10.0,
    )
