"""NATS ``.creds`` files (a user JWT plus the user's nkey seed) and the private inbox a credential implies.

Kept free of other project imports but :mod:`shared.files` (stdlib only): :func:`shared.connection.connect` uses it.
"""

from __future__ import annotations

import re
from pathlib import Path

from shared.files import PRIVATE, write_atomic
from shared.security.nkeyjwt import decode_claims

_JWT_BLOCK = re.compile(r"-----BEGIN NATS USER JWT-----\s*(\S+)\s*------END NATS USER JWT------")


def creds_text(user_jwt: str, seed: str) -> str:
    """The layout nsc and every NATS client read."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def read_user_jwt(creds: str | Path) -> str:
    match = _JWT_BLOCK.search(Path(creds).read_text())
    if match is None:
        raise ValueError(f"{creds}: no NATS user JWT in this credentials file")
    return match.group(1)


def inbox_prefix(creds: str | Path) -> str:
    """``_INBOX.<user public key>``: the only inbox the role templates let a user subscribe to, so no user
    can read the replies (JetStream acks, request answers) meant for another."""
    return f"_INBOX.{decode_claims(read_user_jwt(creds))['sub']}"


def write_private(path: Path, text: str) -> Path:
    """Write a secret readable by its owner only (created 0600, never world-readable even briefly), whole."""
    return write_atomic(path, text, mode=PRIVATE)
