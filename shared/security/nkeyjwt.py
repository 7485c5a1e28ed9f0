"""NATS nkeys and the JWTs of NATS decentralized auth (operator → account → user), signed locally.

Only what the server verifies is produced: the ``ed25519-nkey`` header, claims of schema version 2, and a
base64url signature by the issuer's nkey. ``nkeys`` (the NATS reference implementation, already needed by
nats-py to answer the server's nonce) does the key encoding and signing; this module adds types.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import nkeys

JWT_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class KeyKind(IntEnum):
    """nkeys prefix bytes: the first letter of a public key says what it identifies."""

    OPERATOR = nkeys.PREFIX_BYTE_OPERATOR
    ACCOUNT = nkeys.PREFIX_BYTE_ACCOUNT
    USER = nkeys.PREFIX_BYTE_USER


@dataclass(frozen=True)
class KeyPair:
    """An nkey: ``seed`` is the secret (``S…``), ``public_key`` the identity (``O…``, ``A…``, ``U…``)."""

    seed: str
    public_key: str

    @classmethod
    def generate(cls, kind: KeyKind) -> KeyPair:
        seed: bytes = nkeys.encode_seed(os.urandom(32), int(kind))
        return cls.from_seed(seed.decode())

    @classmethod
    def from_seed(cls, seed: str) -> KeyPair:
        pair = nkeys.from_seed(bytearray(seed.strip().encode()))
        public: bytes = pair.public_key
        return cls(seed=seed.strip(), public_key=public.decode())

    def sign(self, data: bytes) -> bytes:
        signature: bytes = nkeys.from_seed(bytearray(self.seed.encode())).sign(data)
        return signature


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(
    *,
    issuer: KeyPair,
    subject: str,
    name: str,
    nats: dict[str, Any],
) -> str:
    """Sign claims with ``issuer``; ``nats`` is the type-specific body (``type`` and ``version`` included)."""
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public_key,
        "name": name,
        "sub": subject,
        "nats": nats,
    }
    # The jti only has to be unique; hashing the claims (as the Go library does) makes it reproducible.
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode()
    signing_input = f"{_b64url(json.dumps(JWT_HEADER).encode())}.{_b64url(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64url(issuer.sign(signing_input.encode()))}"


def decode_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the NATS server is the one that verifies)."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT")
    claims: dict[str, Any] = json.loads(_b64url_decode(parts[1]))
    return claims
