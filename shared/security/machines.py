"""Machines joining a cluster with one command: what a join token carries and what a server machine receives.

A machine token (``zjt2``) is a join token (``zjt1``: a single-use secret and the public join sentinel) plus
where to go and whom to trust: the cluster's client URLs and its CA certificate, so the new machine needs
nothing copied by hand and verifies the servers before it sends its secret. A *server* token also leads to
the cluster's trust root: ``zattera nodes join-token --server``, run on a server machine, packs that
machine's security directory (keys, route secret, CA and its key; never credentials or configs, which are
re-derived) and encrypts it with a key derived from the token's secret (HKDF-SHA256, AES-256-GCM). The join
service stores only the ciphertext with the token's record and hands it to whoever redeems the token, which
alone can decrypt it: the bucket, the service's logs and anyone who reads the reply learn nothing.
"""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from shared.errors import ZatteraError
from shared.security.creds import write_private

MACHINE_TOKEN_PREFIX = "zjt2"
BUNDLE_INFO = b"zattera server bundle v1"
SERVER_BUNDLE_FILES = (
    "keys",
    "accounts.json",
    "join-sentinel.jwt",
    "route.secret",
    "tls/ca.pem",
    "tls/ca-key.pem",
)
"""What a server machine receives of the security directory: the trust root. Credentials, the server
configuration and its own TLS certificate are made again on the machine from these."""
CONTROL_BUNDLE_FILES = ("secrets/cluster.key", "certs/local-ca.key", "certs/local-ca.pem")
"""What it receives of the rest of the control directory (the security directory's parent), under
``control/`` in the bundle: the cluster secrets key and the local CA, so that its secrets and certificates
services hold what every replica must (a replica without the key would answer requests it cannot serve)."""
CONTROL_PREFIX = "control/"


class MachineTokenError(ZatteraError):
    """A token that is not a machine token, or whose bundle cannot be opened with its secret."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class MachineToken:
    """``zjt2.<secret>.<sentinel JWT>.<where>``: ``where`` is base64url JSON ``{"urls": [...], "ca": PEM}``."""

    secret: str
    sentinel_jwt: str
    urls: tuple[str, ...]
    ca_pem: str = ""

    def __str__(self) -> str:
        where = _b64(json.dumps({"urls": list(self.urls), "ca": self.ca_pem}, separators=(",", ":")).encode())
        return f"{MACHINE_TOKEN_PREFIX}.{self.secret}.{self.sentinel_jwt}.{where}"

    @property
    def join_token(self) -> str:
        """The part the join service checks (the ``zjt1`` form: secret and sentinel)."""
        return f"zjt1.{self.secret}.{self.sentinel_jwt}"

    @classmethod
    def parse(cls, text: str) -> MachineToken:
        parts = text.strip().split(".")
        if len(parts) != 6 or parts[0] != MACHINE_TOKEN_PREFIX:
            raise MachineTokenError(
                "malformed join token: expected the whole zjt2.… string printed by zattera nodes join-token"
            )
        try:
            where = json.loads(_unb64(parts[5]))
            urls = tuple(str(u) for u in where["urls"])
            ca = str(where.get("ca") or "")
        except (ValueError, KeyError, TypeError):
            raise MachineTokenError("malformed join token: its cluster address part is damaged") from None
        if not urls:
            raise MachineTokenError("malformed join token: it names no server to join")
        return cls(parts[1], ".".join(parts[2:5]), urls, ca)


def _key(secret: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=BUNDLE_INFO).derive(secret.encode())


def seal_bundle(secret: str, security_dir: Path) -> str:
    """The server bundle of ``security_dir`` encrypted under ``secret`` (base64url)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name in SERVER_BUNDLE_FILES:
            path = security_dir / name
            if path.exists():
                archive.add(path, arcname=name)
        for name in CONTROL_BUNDLE_FILES:
            path = security_dir.parent / name
            if path.exists():
                archive.add(path, arcname=CONTROL_PREFIX + name)
    nonce = os.urandom(12)
    return _b64(nonce + AESGCM(_key(secret)).encrypt(nonce, buffer.getvalue(), BUNDLE_INFO))


def open_bundle(secret: str, sealed: str, security_dir: Path) -> None:
    """Decrypt a server bundle and write its files into ``security_dir`` (0600, directories 0700)."""
    try:
        raw = _unb64(sealed)
        plain = AESGCM(_key(secret)).decrypt(raw[:12], raw[12:], BUNDLE_INFO)
    except Exception as exc:  # InvalidTag, bad base64: the same answer either way
        raise MachineTokenError("the server bundle does not open with this token's secret") from exc
    with tarfile.open(fileobj=io.BytesIO(plain), mode="r:gz") as archive:
        for member in archive.getmembers():
            if not member.isfile():
                continue
            inner = member.name.removeprefix(CONTROL_PREFIX)
            control = member.name.startswith(CONTROL_PREFIX) and inner in CONTROL_BUNDLE_FILES
            base = security_dir.parent if control else security_dir
            target = (base / (inner if control else member.name)).resolve()
            if not target.is_relative_to(base.resolve()):
                raise MachineTokenError(f"the server bundle names a file outside the security directory: {member.name}")
            extracted = archive.extractfile(member)
            assert extracted is not None
            write_private(target, extracted.read().decode())
