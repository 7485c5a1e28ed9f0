"""Sealed secrets: the cluster key, node keys, and the request an agent makes at spawn (docs/secrets.md).

* The **cluster secrets key** is an X25519 key pair (NaCl ``PrivateKey``). Its private half lives only with
  the secrets service (a 0600 key file, or ``ZATTERA_SECRETS_KEY``); its public half is published in the
  state bucket (``secretskey.cluster``) so the CLI seals values (``SealedBox``) without ever holding the
  private key. Secrets are stored only as ciphertext (``secret.<id>``).
* Each **agent** makes its own X25519 pair at registration, publishes the public half in its ``Node`` record
  and keeps the private half in memory only.
* At spawn the agent asks ``zattera.secrets.<node>.open`` for an assignment's secrets; the secrets service
  answers only for an assignment on that node, sealed to that node's public key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.files import PRIVATE, create_once, write_atomic

CLUSTER_KEY = "cluster"
"""The id of the one ``secretskey.<id>`` record: the cluster key's public half."""
ROTATE_SUBJECT = "zattera.secrets.rotate"
SECRETS_QUEUE = "zattera-secrets"


def open_subject(node_id: str) -> str:
    """Where node ``node_id`` asks for its instances' secrets (only its credential may publish there)."""
    return f"zattera.secrets.{node_id}.open"


class SecretsUnavailable(ZatteraError):
    """An agent could not get an instance's secrets (the reason never contains a value)."""


class SecretsServiceSilent(SecretsUnavailable):
    """No secrets service answered (none running yet, or all restarting): worth asking again, not a refusal."""


def key_id(public_key: bytes) -> str:
    return hashlib.sha256(public_key).hexdigest()[:16]


def seal(public_key: bytes, plaintext: bytes) -> bytes:
    return bytes(SealedBox(PublicKey(public_key)).encrypt(plaintext))


def unseal(private_key: PrivateKey, ciphertext: bytes) -> bytes:
    """Raises ``nacl.exceptions.CryptoError`` when ``ciphertext`` was not sealed to this key."""
    return bytes(SealedBox(private_key).decrypt(ciphertext))


def public_bytes(private_key: PrivateKey) -> bytes:
    return bytes(private_key.public_key)


class KeyMaterialError(ZatteraError, ValueError):
    """The cluster key material is unusable (bad file, bad ZATTERA_SECRETS_KEY)."""


@dataclass
class Keyring:
    """The cluster key pairs the secrets service holds: ``keys[0]`` is current; more than one only while a
    rotation re-seals (and after a rotation that did not finish)."""

    keys: list[PrivateKey]

    @property
    def current(self) -> PrivateKey:
        return self.keys[0]

    def by_id(self, ident: str) -> PrivateKey | None:
        return next((k for k in self.keys if key_id(public_bytes(k)) == ident), None)


def private_key_from_hex(text: str) -> PrivateKey:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise KeyMaterialError("ZATTERA_SECRETS_KEY: not hex (expected 64 hex digits)") from None
    if len(raw) != 32:
        raise KeyMaterialError(f"ZATTERA_SECRETS_KEY: {len(raw)} bytes; expected 32 (64 hex digits)")
    return PrivateKey(raw)


def load_keyring(path: Path) -> Keyring | None:
    """The keyring file (JSON ``{"keys": [hex, …]}``), None when there is none."""
    try:
        doc = json.loads(path.read_text())
        keys = [PrivateKey(bytes.fromhex(h)) for h in doc["keys"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeyMaterialError(f"{path}: not a secrets key file ({type(exc).__name__})") from None
    if not keys:
        raise KeyMaterialError(f"{path}: holds no key")
    return Keyring(keys)


def _keyring_json(keyring: Keyring) -> bytes:
    return json.dumps({"keys": [bytes(k).hex() for k in keyring.keys]}).encode()


def save_keyring(path: Path, keyring: Keyring) -> None:
    """Replace the keyring file atomically (0600)."""
    write_atomic(path, _keyring_json(keyring), mode=PRIVATE)


def create_keyring(path: Path, keyring: Keyring) -> Keyring:
    """Write the first keyring unless the file exists; returns the keyring on disk (ours, or the one another
    replica sharing the file created first: two replicas starting together never each make a key)."""
    if create_once(path, _keyring_json(keyring), mode=PRIVATE):
        return keyring
    existing = load_keyring(path)
    if existing is None:
        raise KeyMaterialError(f"{path}: vanished while being created")
    return existing


async def fetch_secrets(
    conn: Connection, node_id: str, node_key: PrivateKey, assignment_id: str, *, timeout: float = 5.0
) -> dict[str, str]:
    """An assignment's secret values, opened with this node's private key (kept in memory by the caller)."""
    request = cpb.OpenSecretsRequest(
        node_id=node_id, assignment_id=assignment_id, node_public_key=public_bytes(node_key)
    )
    try:
        msg = await conn.nc.request(open_subject(node_id), request.SerializeToString(), timeout=timeout)
    except Exception as exc:  # no responder, timeout, connection trouble: the next start attempt retries
        raise SecretsServiceSilent(f"the secrets service did not answer ({type(exc).__name__})") from None
    response = cpb.OpenSecretsResponse.FromString(msg.data)
    if response.error:
        raise SecretsUnavailable(response.error)
    try:
        values = cpb.SecretValues.FromString(unseal(node_key, response.sealed))
    except CryptoError:
        raise SecretsUnavailable("the answer was not sealed to this node's key") from None
    return dict(values.values)
