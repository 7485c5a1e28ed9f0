"""``python -m services.join``: run with the control credential and ``ZATTERA_DATA_DIR`` holding ``security/``.

It opens the CLI's watches (``zattera.watch.open``, shared/watches.py) and changes every stream's replica
count (``zattera.cluster.replicas``, shared/replicas.py) on every cluster, secured or not. It
reads the agent, builder and proxy scoped signing keys to mint node credentials; on a server machine it
also re-signs the role accounts for revocations (``zattera nodes remove``) with the machine's trust root.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from services.join.settings import MachineSettings
from shared.replicas import CLUSTER_REPLICAS_SUBJECT
from shared.replicas import handler as replicas_handler
from shared.security.accounts import Account
from shared.security.authority import RoleIssuer
from shared.security.authz import Authz
from shared.security.join import JoinService
from shared.security.machine_service import Machines
from shared.security.permissions import VIEW_OPEN_SUBJECT, Role
from shared.security.setup import SENTINEL_FILE
from shared.security.views import open_cluster_view_handler
from shared.service import ServiceContext, main
from shared.watch_server import serve, serve_watches

log = logging.getLogger(__name__)

MACHINE_NODE_ENV = "ZATTERA_MACHINE_NODE"
MACHINE_CLIENT_URL_ENV = "ZATTERA_MACHINE_CLIENT_URL"
MACHINE_ROUTE_URL_ENV = "ZATTERA_MACHINE_ROUTE_URL"
MACHINE_MESH_IP_ENV = "ZATTERA_MACHINE_MESH_IP"
MACHINE_SERVER_NAMES_ENV = "ZATTERA_MACHINE_SERVER_NAMES"
"""Set by ``zattera up`` on a server machine (read as :class:`MachineSettings`): its node id and where other
machines reach its NATS server."""


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    directory = ctx.settings.data_dir / "security"
    authz = None
    if (directory / SENTINEL_FILE).exists() and ctx.settings.nats_creds:
        # Team members' authorising path (docs/teams.md): the member role key mints their credentials.
        publics = json.loads((directory / "accounts.json").read_text())
        if str(Account.MEMBERS) in publics:  # a setup from before teams has no members (and no MEMBERS account)
            # A machine without the member role key still checks members; it only cannot mint credentials.
            has_key = (directory / "keys" / f"role-{Role.MEMBER}.nk").exists()
            authz = Authz(
                ctx.conn,
                publics[str(Account.MEMBERS)],
                issuer=RoleIssuer.load(directory, Role.MEMBER) if has_key else None,
                admins_account=publics[str(Account.OPERATORS)],
            )
    # The CLI's watches are opened here on every cluster, secured or not (shared/watches.py).
    watches = serve_watches(ctx.conn, authorize=authz.authorize_watch if authz else None)
    # `zattera cluster replicas N`: the CLI changes no stream itself (shared/replicas.py).
    replicas = serve(ctx.conn, CLUSTER_REPLICAS_SUBJECT, replicas_handler(ctx.conn.nc))
    if not (directory / SENTINEL_FILE).exists():
        # An unsecured cluster lets agents connect as they are: no tokens to exchange, no writes to relay; the
        # agents' views are the same consumers as when secured, for the node each request names.
        log.warning("join: no security setup in %s (zattera up --secure makes one): watches and views only", directory)
        return [watches, replicas, serve(ctx.conn, VIEW_OPEN_SUBJECT, open_cluster_view_handler(ctx.conn))]
    issuers = {role: RoleIssuer.load(directory, role) for role in (Role.AGENT, Role.BUILDER, Role.PROXY)}
    sentinel = (directory / SENTINEL_FILE).read_text().strip()
    # Keys prepared but the server not secured (no credential of our own): nobody has an identity there.
    open_cluster = not ctx.settings.nats_creds
    machines = None
    if not open_cluster:
        machine = MachineSettings()
        machines = Machines(
            ctx.conn,
            ctx.settings.nats_url,
            directory,
            tls_ca=ctx.settings.nats_tls_ca,
            node_id=machine.node,
            client_url=machine.client_url,
            route_url=machine.route_url,
            mesh_ip=machine.mesh_ip,
            server_names=[n for n in machine.server_names.split(",") if n],
            control_dir=ctx.settings.data_dir,
        )
    service = JoinService(ctx.conn, issuers, sentinel, open_cluster=open_cluster, machines=machines, authz=authz)
    return [watches, replicas, service.run()]


if __name__ == "__main__":
    main("join", build)
