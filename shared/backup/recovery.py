"""The cluster secrets key sealed to a recovery passphrase: without the passphrase a backup restores nothing
secret.

The key is derived from the passphrase with Argon2id (libsodium's ``crypto_pwhash`` through PyNaCl, a
memory-hard KDF: "moderate" limits, 256 MiB and 3 passes, recorded beside the ciphertext so they can grow)
and the keyring is sealed with XSalsa20-Poly1305 (``SecretBox``), whose tag tells a wrong passphrase.

Scheduled backups run where nobody types a passphrase, and the cluster must not hold it: ``zattera backup
schedule`` derives an X25519 key pair from the passphrase (Argon2id of a fresh salt as the seed) and gives the
cluster only the public half, a *recipient*; each scheduled backup seals the keyring to it (``SealedBox``).
:func:`unseal` opens both forms with the passphrase.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from nacl import public, pwhash, secret, utils
from nacl.exceptions import CryptoError

from shared.backup.manifest import BackupError

KDF = "argon2id"
RECIPIENT_KDF = "argon2id-x25519"
"""A keyring sealed to a recipient: the private key is Argon2id(passphrase, salt) as an X25519 seed."""
OPSLIMIT = pwhash.argon2id.OPSLIMIT_MODERATE
MEMLIMIT = pwhash.argon2id.MEMLIMIT_MODERATE
MIN_PASSPHRASE = 12
"""Characters a recovery passphrase has at least."""


class WrongPassphrase(BackupError):
    """The recovery passphrase does not open the backup's secrets key."""


class WeakPassphrase(BackupError, ValueError):
    """A recovery passphrase too short to protect a backup stored off-site."""


def check_passphrase(passphrase: str) -> None:
    if len(passphrase) < MIN_PASSPHRASE:
        raise WeakPassphrase(f"recovery passphrase: at least {MIN_PASSPHRASE} characters (got {len(passphrase)})")


def _key(passphrase: str, salt: bytes, opslimit: int, memlimit: int) -> bytes:
    return pwhash.argon2id.kdf(
        secret.SecretBox.KEY_SIZE, passphrase.encode(), salt, opslimit=opslimit, memlimit=memlimit
    )


def _fresh_key(passphrase: str, kdf: str, opslimit: int | None, memlimit: int | None) -> tuple[bytes, dict[str, Any]]:
    """The key ``passphrase`` derives with a fresh salt (the limits default to :data:`OPSLIMIT` and
    :data:`MEMLIMIT`), and the document that records how: ``kdf``, the limits and the salt."""
    check_passphrase(passphrase)
    opslimit = OPSLIMIT if opslimit is None else opslimit
    memlimit = MEMLIMIT if memlimit is None else memlimit
    salt = utils.random(pwhash.argon2id.SALTBYTES)
    doc: dict[str, Any] = {
        "kdf": kdf,
        "opslimit": opslimit,
        "memlimit": memlimit,
        "salt": base64.b64encode(salt).decode(),
    }
    return _key(passphrase, salt, opslimit, memlimit), doc


def seal(plaintext: bytes, passphrase: str, *, opslimit: int | None = None, memlimit: int | None = None) -> bytes:
    """``plaintext`` sealed to ``passphrase``: a JSON document of the KDF's parameters (default
    :data:`OPSLIMIT`, :data:`MEMLIMIT`) and the ciphertext."""
    key, doc = _fresh_key(passphrase, KDF, opslimit, memlimit)
    doc["box"] = base64.b64encode(bytes(secret.SecretBox(key).encrypt(plaintext))).decode()
    return json.dumps(doc).encode()


def recipient(passphrase: str, *, opslimit: int | None = None, memlimit: int | None = None) -> bytes:
    """The public recipient of ``passphrase`` (JSON: the KDF's parameters, a fresh salt, the X25519 public
    key): what :func:`seal_to` needs, and nothing that opens what it seals."""
    key, doc = _fresh_key(passphrase, RECIPIENT_KDF, opslimit, memlimit)
    doc["public"] = base64.b64encode(bytes(public.PrivateKey(key).public_key)).decode()
    return json.dumps(doc).encode()


def check_recipient(doc: bytes) -> None:
    """:class:`BackupError` unless ``doc`` is a recipient :func:`recipient` made."""
    _recipient_fields(doc)


def _recipient_fields(doc: bytes) -> dict[str, Any]:
    try:
        fields: dict[str, Any] = json.loads(doc)
        if fields["kdf"] != RECIPIENT_KDF:
            raise BackupError(f"recovery recipient: made with {fields['kdf']!r}, which this Zattera does not know")
        public.PublicKey(base64.b64decode(fields["public"]))
        base64.b64decode(fields["salt"])
        int(fields["opslimit"]), int(fields["memlimit"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"recovery recipient: not a recipient ({type(exc).__name__})") from None
    return fields


def seal_to(plaintext: bytes, recipient_doc: bytes) -> bytes:
    """``plaintext`` sealed to a :func:`recipient` (no passphrase needed); :func:`unseal` opens it."""
    fields = _recipient_fields(recipient_doc)
    box = public.SealedBox(public.PublicKey(base64.b64decode(fields["public"])))
    doc = {**fields, "box": base64.b64encode(box.encrypt(plaintext)).decode()}
    return json.dumps(doc).encode()


def unseal(sealed: bytes, passphrase: str) -> bytes:
    """The plaintext :func:`seal` or :func:`seal_to` sealed; :class:`WrongPassphrase` when ``passphrase``
    does not open it."""
    try:
        doc = json.loads(sealed)
        if doc["kdf"] not in (KDF, RECIPIENT_KDF):
            raise BackupError(f"secrets key: sealed with {doc['kdf']!r}, which this Zattera does not know")
        salt, box = base64.b64decode(doc["salt"]), base64.b64decode(doc["box"])
        key = _key(passphrase, salt, int(doc["opslimit"]), int(doc["memlimit"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"secrets key: not a sealed key ({type(exc).__name__})") from None
    try:
        if doc["kdf"] == RECIPIENT_KDF:
            return bytes(public.SealedBox(public.PrivateKey(key)).decrypt(box))
        return bytes(secret.SecretBox(key).decrypt(box))
    except CryptoError:
        raise WrongPassphrase("the recovery passphrase does not open this backup's secrets key") from None
