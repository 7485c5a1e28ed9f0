"""Sealing of stored snapshot objects: AES-256-GCM with the cluster data key (``ZATTERA_SNAPSHOT_KEY``).

Object bytes = nonce (12, fresh random per object) ‖ ciphertext ‖ tag (16), no associated data.
Nonces are never derived from content, so the same chunk sealed twice gives different bytes. Without a
key (a cluster that did not configure one) objects are stored as they are.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from shared.errors import ZatteraError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
NONCE_BYTES = 12


class SealError(ZatteraError):
    """Wrong key, or the object was damaged."""


class Sealer:
    def __init__(self, key: bytes = b"") -> None:
        if key and len(key) != KEY_BYTES:
            raise ValueError(f"snapshot data key must be {KEY_BYTES} bytes, got {len(key)}")
        self._aead: AESGCM | None = None
        if key:  # loaded here, when a snapshot is sealed: an agent at idle does without the library (~7 MB)
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(key)

    @property
    def encrypts(self) -> bool:
        return self._aead is not None

    def seal(self, plaintext: bytes) -> bytes:
        if self._aead is None:
            return plaintext
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, None)

    def open(self, sealed: bytes) -> bytes:
        if self._aead is None:
            return sealed
        if len(sealed) < NONCE_BYTES + 16:
            raise SealError("sealed object too short")
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], None)
        except InvalidTag as exc:
            raise SealError("authentication failed (wrong key or damaged object)") from exc
