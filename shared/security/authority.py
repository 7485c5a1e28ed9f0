"""The trust root of a secured cluster: operator, accounts, role signing keys, and what the server loads.

Layout of the security directory (``<data_dir>/security`` for ``zattera up --secure``), every secret 0600:

- ``keys/operator.nk``, ``keys/system.nk``, ``keys/zattera.nk``, ``keys/join.nk``: identity seeds; only
  needed to re-sign the account JWTs (rotation, revocation), so they can live offline in production;
- ``keys/role-<role>.nk``: one scoped signing key per role; the join service reads only ``agent`` and
  ``builder``;
- ``accounts.json``: public keys and revocations (not secret);
- ``nats-auth.conf``: the server fragment (operator JWT, memory resolver with the account JWTs preloaded);
- ``creds/``: issued credentials.

Accounts, one per *role* (SECURITY.md): ``SYS`` (the server's system account), ``ZATTERA`` (JetStream on;
every bucket, stream and the control services), ``AGENTS``, ``PROXIES`` and ``OPERATORS`` (no JetStream; each
imports from ``ZATTERA`` only the subjects its roles publish, see :mod:`shared.security.accounts`) and
``JOIN`` (no JetStream, a few connections; its only reach into ZATTERA is the imported ``zattera.join``
service). A role account has no stream: a reply or acknowledgement it steers to any subject lands in the
role account (replies to imported services travel back through ``_R_`` mappings), never in a bucket.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.security.accounts import (
    ROLE_ACCOUNT,
    ROLE_ACCOUNTS,
    Account,
    agents_exports,
    role_account_imports,
    zattera_exports,
    zattera_imports,
)
from shared.security.creds import creds_text, write_private
from shared.security.nkeyjwt import KeyKind, KeyPair, encode_jwt
from shared.security.permissions import JOIN, JOIN_SUBJECT, ROLE_PERMISSIONS, Role

UNLIMITED_ACCOUNT: dict[str, Any] = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}
JETSTREAM_UNLIMITED: dict[str, Any] = {
    "mem_storage": -1,
    "disk_storage": -1,
    "streams": -1,
    "consumer": -1,
    "max_ack_pending": -1,
}
JETSTREAM_OFF: dict[str, Any] = {"mem_storage": 0, "disk_storage": 0, "streams": 0, "consumer": 0}
# The join account is reachable with a public credential: bound it so it cannot exhaust the server.
JOIN_ACCOUNT_LIMITS: dict[str, Any] = {
    **UNLIMITED_ACCOUNT,
    "conn": 64,
    "subs": 256,
    "payload": 16 * 1024,
    "exports": 0,
    **JETSTREAM_OFF,
}
SIGNED_ROLES = (Role.CONTROL, Role.OPERATOR, Role.AGENT, Role.BUILDER, Role.PROXY, Role.MEMBER)


def _role_key(path: Path) -> KeyPair:
    """A deleted role key is replaced by a new one: that is how a role's signing key is rotated."""
    if path.exists():
        return KeyPair.from_seed(path.read_text())
    return KeyPair.generate(KeyKind.ACCOUNT)


@dataclass(frozen=True)
class RoleIssuer:
    """Mints users of one role: its scoped signing key and the account's public key. Nothing else."""

    role: Role
    signing_key: KeyPair
    account_public_key: str

    def user_jwt(self, name: str, user_public_key: str) -> str:
        """No permissions in the user JWT: the server applies the scope's template (and requires that)."""
        return encode_jwt(
            issuer=self.signing_key,
            subject=user_public_key,
            name=name,
            nats={"type": "user", "version": 2, "issuer_account": self.account_public_key},
        )

    def creds(self, name: str) -> str:
        """A new user of this role named ``name`` (an agent's node id, a proxy's id) with its seed."""
        user = KeyPair.generate(KeyKind.USER)
        return creds_text(self.user_jwt(name, user.public_key), user.seed)

    @classmethod
    def load(cls, directory: Path, role: Role) -> RoleIssuer:
        publics = json.loads((directory / "accounts.json").read_text())
        seed = (directory / "keys" / f"role-{role}.nk").read_text()
        return cls(role, KeyPair.from_seed(seed), publics[str(ROLE_ACCOUNT[role])])


def _account_key(path: Path) -> KeyPair:
    """An account added by a later version (the role accounts) is created on the next ``prepare``."""
    if path.exists():
        return KeyPair.from_seed(path.read_text())
    return KeyPair.generate(KeyKind.ACCOUNT)


@dataclass
class Authority:
    operator: KeyPair
    system: KeyPair
    zattera: KeyPair
    join: KeyPair
    role_keys: dict[Role, KeyPair]
    role_accounts: dict[Account, KeyPair]
    # user public key -> epoch seconds: the server refuses that user's JWTs issued before that time.
    revocations: dict[str, int] = field(default_factory=dict)

    @classmethod
    def generate(cls) -> Authority:
        return cls(
            operator=KeyPair.generate(KeyKind.OPERATOR),
            system=KeyPair.generate(KeyKind.ACCOUNT),
            zattera=KeyPair.generate(KeyKind.ACCOUNT),
            join=KeyPair.generate(KeyKind.ACCOUNT),
            role_keys={role: KeyPair.generate(KeyKind.ACCOUNT) for role in SIGNED_ROLES},
            role_accounts={account: KeyPair.generate(KeyKind.ACCOUNT) for account in ROLE_ACCOUNTS},
        )

    @classmethod
    def load(cls, directory: Path) -> Authority:
        keys = directory / "keys"
        publics = json.loads((directory / "accounts.json").read_text())
        return cls(
            operator=KeyPair.from_seed((keys / "operator.nk").read_text()),
            system=KeyPair.from_seed((keys / "system.nk").read_text()),
            zattera=KeyPair.from_seed((keys / "zattera.nk").read_text()),
            join=KeyPair.from_seed((keys / "join.nk").read_text()),
            role_keys={role: _role_key(keys / f"role-{role}.nk") for role in SIGNED_ROLES},
            role_accounts={account: _account_key(keys / f"{account}.nk") for account in ROLE_ACCOUNTS},
            revocations={str(k): int(v) for k, v in publics.get("revocations", {}).items()},
        )

    @classmethod
    def load_or_create(cls, directory: Path) -> Authority:
        if (directory / "accounts.json").exists():
            return cls.load(directory)
        authority = cls.generate()
        authority.save(directory)
        return authority

    def save(self, directory: Path) -> None:
        keys = directory / "keys"
        write_private(keys / "operator.nk", self.operator.seed)
        write_private(keys / "system.nk", self.system.seed)
        write_private(keys / "zattera.nk", self.zattera.seed)
        write_private(keys / "join.nk", self.join.seed)
        for role, pair in self.role_keys.items():
            write_private(keys / f"role-{role}.nk", pair.seed)
        for account, pair in self.role_accounts.items():
            write_private(keys / f"{account}.nk", pair.seed)
        publics = {
            "operator": self.operator.public_key,
            "system": self.system.public_key,
            "join": self.join.public_key,
            **{str(account): key for account, key in self.account_keys().items()},
            "revocations": self.revocations,
        }
        write_private(directory / "accounts.json", json.dumps(publics, indent=2))
        write_private(directory / "nats-auth.conf", self.server_config())

    def account_keys(self) -> dict[Account, str]:
        return {
            Account.ZATTERA: self.zattera.public_key,
            **{account: pair.public_key for account, pair in self.role_accounts.items()},
        }

    def issuer(self, role: Role) -> RoleIssuer:
        return RoleIssuer(role, self.role_keys[role], self.account_keys()[ROLE_ACCOUNT[role]])

    def revoke(self, user_public_key: str) -> None:
        """Refuse every JWT of that user issued until now (takes effect when the server reloads the config)."""
        self.revocations[user_public_key] = int(time.time()) + 1

    # JWTs ------------------------------------------------------------------------------------------

    def operator_jwt(self) -> str:
        return encode_jwt(
            issuer=self.operator,
            subject=self.operator.public_key,
            name="zattera",
            nats={"type": "operator", "version": 2, "system_account": self.system.public_key},
        )

    def system_account_jwt(self) -> str:
        body: dict[str, Any] = {"limits": {**UNLIMITED_ACCOUNT, **JETSTREAM_OFF}}
        if self.revocations:  # a removed server machine's system user (``zattera nodes remove``)
            body["revocations"] = self.revocations
        return self._account_jwt(self.system, "SYS", body)

    def _scopes(self, account: Account) -> list[dict[str, Any]]:
        """The scoped signing keys of the roles living in ``account``: the server applies the template."""
        return [
            {
                "kind": "user_scope",
                "key": self.role_keys[role].public_key,
                "role": str(role),
                "template": ROLE_PERMISSIONS[role].claims(),
                "description": f"users of role {role}",
            }
            for role in SIGNED_ROLES
            if ROLE_ACCOUNT[role] is account
        ]

    def _account_body(self, account: Account, limits: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "limits": limits,
            "signing_keys": self._scopes(account),
            # A user JWT signed by the account key itself (never done here) would get nothing.
            "default_permissions": {"pub": {"deny": [">"]}, "sub": {"deny": [">"]}},
        }
        if self.revocations:
            body["revocations"] = self.revocations
        return body

    def zattera_account_jwt(self) -> str:
        body = self._account_body(Account.ZATTERA, {**UNLIMITED_ACCOUNT, **JETSTREAM_UNLIMITED})
        join_export = {"name": "join", "subject": JOIN_SUBJECT, "type": "service", "response_type": "Singleton"}
        body["exports"] = [join_export, *zattera_exports()]
        body["imports"] = zattera_imports(self.account_keys())
        return self._account_jwt(self.zattera, "ZATTERA", body)

    def role_account_jwt(self, account: Account) -> str:
        """A role account: no JetStream, so nothing a reply lands on there is ever stored."""
        body = self._account_body(account, {**UNLIMITED_ACCOUNT, **JETSTREAM_OFF})
        body["imports"] = role_account_imports(account, self.account_keys())
        if account is Account.AGENTS:
            body["exports"] = agents_exports()
        return self._account_jwt(self.role_accounts[account], account.upper(), body)

    def join_account_jwt(self) -> str:
        imports = [
            {"name": "join", "subject": JOIN_SUBJECT, "account": self.zattera.public_key, "type": "service"},
        ]
        return self._account_jwt(self.join, "JOIN", {"limits": JOIN_ACCOUNT_LIMITS, "imports": imports})

    def _account_jwt(self, account: KeyPair, name: str, body: dict[str, Any]) -> str:
        return encode_jwt(
            issuer=self.operator,
            subject=account.public_key,
            name=name,
            nats={"type": "account", "version": 2, **body},
        )

    def system_user_creds(self) -> str:
        """A user of ``SYS`` (signed by the system account key): may push account JWT updates
        (``$SYS.REQ.CLAIMS.UPDATE``); held by control machines only."""
        user = KeyPair.generate(KeyKind.USER)
        jwt = encode_jwt(
            issuer=self.system,
            subject=user.public_key,
            name="system",
            nats={"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1},
        )
        return creds_text(jwt, user.seed)

    def join_sentinel_jwt(self) -> str:
        """The public bearer credential every joining agent presents: it can only request ``zattera.join``."""
        sentinel = KeyPair.generate(KeyKind.USER)
        return encode_jwt(
            issuer=self.join,
            subject=sentinel.public_key,
            name="join",
            nats={"type": "user", "version": 2, **JOIN.claims()},
        )

    def server_config(self) -> str:
        """The nats-server fragment: operator mode with every account JWT preloaded (no resolver service)."""
        preload = {
            self.system.public_key: self.system_account_jwt(),
            self.zattera.public_key: self.zattera_account_jwt(),
            self.join.public_key: self.join_account_jwt(),
            **{pair.public_key: self.role_account_jwt(account) for account, pair in self.role_accounts.items()},
        }
        lines = [
            f'operator: "{self.operator_jwt()}"',
            f'system_account: "{self.system.public_key}"',
            "resolver: MEMORY",
            "resolver_preload: {",
            *(f'  {account}: "{jwt}"' for account, jwt in preload.items()),
            "}",
        ]
        return "\n".join(lines) + "\n"
