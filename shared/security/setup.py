"""What ``zattera up --secure`` prepares in ``<data_dir>/control/security`` (idempotent: a restart reuses it
all)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from shared.embedded import RouteSecurity
from shared.security import tls as tls_material
from shared.security.authority import Authority, RoleIssuer
from shared.security.creds import read_user_jwt, write_private
from shared.security.nkeyjwt import decode_claims
from shared.security.permissions import Role

SENTINEL_FILE = "join-sentinel.jwt"
ROUTE_SECRET_FILE = "route.secret"
ROUTE_USER = "route"


@dataclass(frozen=True)
class SecureSetup:
    directory: Path
    tls: tls_material.TlsFiles | None

    @property
    def control_creds(self) -> Path:
        return self.directory / "creds" / "control.creds"

    @property
    def operator_creds(self) -> Path:
        return self.directory / "creds" / "operator.creds"

    @property
    def tls_ca(self) -> Path | None:
        return self.tls.ca if self.tls else None

    @property
    def system_creds(self) -> Path:
        """A user of the system account: pushes re-signed account JWTs (revocations) to the servers."""
        return self.directory / "creds" / "system.creds"

    def server_config(self, resolver_dir: str = "") -> str:
        """Everything to add to the embedded server's config: operator-mode auth, and TLS when enabled.
        ``resolver_dir``: the NATS *full* resolver keeps the account JWTs there (preloaded from this setup),
        so a re-signed account (a revocation) pushed to one server reaches every server of the cluster
        without a restart; without it, the memory resolver (a config reload applies changes)."""
        config = (self.directory / "nats-auth.conf").read_text()
        if resolver_dir:
            full = f'resolver: {{ type: full, dir: "{resolver_dir}", allow_delete: false, interval: "2m" }}'
            config = config.replace("resolver: MEMORY", full)
        return config + (self.tls.server_config() if self.tls else "")

    def route_security(self) -> RouteSecurity:
        """The routes of a secured cluster: authenticated by a shared route secret, and with ``--tls`` over
        TLS verified both ways against the cluster CA. Routes are never open."""
        secret = (self.directory / ROUTE_SECRET_FILE).read_text().strip()
        authorization = f'authorization {{ user: "{ROUTE_USER}", password: "{secret}" }}\n'
        return RouteSecurity(ROUTE_USER, secret, authorization + (self.tls.route_config() if self.tls else ""))

    def creds(self, role: Role, name: str) -> Path:
        """A credentials file for ``name`` of ``role`` under ``creds/`` (kept when it exists: a restart keeps
        identities)."""
        return self.issue(role, name, self.directory / "creds" / f"{role}-{name}.creds")

    def issue(self, role: Role, name: str, path: Path) -> Path:
        """A credentials file for ``name`` of ``role`` at ``path`` (the local node's go to its own directory,
        outside the control plane's); kept when it exists and names the role's current account."""
        issuer = RoleIssuer.load(self.directory, role)
        if not path.exists() or _issuer_account(path) != issuer.account_public_key:
            # New, or issued in the account the role lived in before the role accounts: issue it again.
            write_private(path, issuer.creds(name))
        return path

    def sentinel_jwt(self) -> str:
        return (self.directory / SENTINEL_FILE).read_text().strip()


def _issuer_account(creds: Path) -> str:
    return str(decode_claims(read_user_jwt(creds)).get("nats", {}).get("issuer_account", ""))


def prepare(directory: Path, *, tls: bool = False, hosts: list[str] | None = None) -> SecureSetup:
    """Create (once) the operator, accounts, role keys, service and CLI credentials, the join sentinel and,
    with ``tls``, a CA and server certificate; (re)write the server config from the current role tables."""
    authority = Authority.load_or_create(directory)
    authority.save(directory)  # account JWTs carry the role templates: regenerate them from this code
    setup = SecureSetup(directory, tls_material.load_or_generate(directory / "tls", hosts) if tls else None)
    for role, path in ((Role.CONTROL, setup.control_creds), (Role.OPERATOR, setup.operator_creds)):
        if not path.exists() or _issuer_account(path) != authority.issuer(role).account_public_key:
            write_private(path, authority.issuer(role).creds(str(role)))
    if not (directory / SENTINEL_FILE).exists():
        write_private(directory / SENTINEL_FILE, authority.join_sentinel_jwt())
    if not (directory / ROUTE_SECRET_FILE).exists():
        write_private(directory / ROUTE_SECRET_FILE, secrets.token_urlsafe(32))
    if not setup.system_creds.exists():
        write_private(setup.system_creds, authority.system_user_creds())
    return setup
