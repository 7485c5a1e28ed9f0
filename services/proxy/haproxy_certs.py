"""TLS certificates of the HAProxy engine: the fallback certificate, the crt-list, and the runtime-API
commands that install, replace and remove certificates without a reload (``new ssl cert`` / ``set ssl
cert`` + ``commit ssl cert`` / ``add ssl crt-list`` / ``del ssl crt-list`` + ``del ssl cert``).

A certificate is a PEM holding the chain and its private key, named by the controller that hands it in
(``<name>.pem``). HAProxy picks one per connection by SNI from the names in the certificates themselves
(CN and SANs); a handshake whose SNI matches none gets the fallback (self-signed) certificate.
Private keys are written 0600 and never logged.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shared.security.creds import write_private

FALLBACK_NAME = "zattera-ingress"
FALLBACK_DAYS = 3650
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_PRIVATE_KEY = re.compile(rb"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.*?-----END \1PRIVATE KEY-----", re.DOTALL)


def safe_name(name: str) -> str:
    return _UNSAFE.sub("_", name) or "_"


def digest(pem: str) -> str:
    return hashlib.sha256(pem.encode()).hexdigest()


def self_signed_pem(common_name: str = FALLBACK_NAME) -> str:
    """A self-signed ECDSA P-256 certificate and its key, in one PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=FALLBACK_DAYS))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode() + key_pem.decode()


def pem_problem(pem: str) -> str | None:
    """Why HAProxy would refuse ``pem`` (no certificate, no private key, a key that does not match), or
    None. Checked before anything is written: a bad file in the crt-list would stop HAProxy from starting."""
    data = pem.encode()
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError:
        return "no PEM certificate in it"
    block = _PRIVATE_KEY.search(data)
    if block is None:
        return "no PEM private key in it"
    try:
        key = serialization.load_pem_private_key(block.group(0), password=None)
    except (ValueError, TypeError):
        return "its private key cannot be read (encrypted or malformed)"
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, public) != certificates[0].public_key().public_bytes(
        serialization.Encoding.PEM, public
    ):
        return "its private key does not match its first certificate"
    return None


def ensure_fallback(path: Path) -> None:
    if not path.exists():
        write_private(path, self_signed_pem())


def installed(certs_dir: Path) -> dict[str, str]:
    """name → digest of every certificate file in ``certs_dir`` (what a fresh or reloaded HAProxy loads)."""
    if not certs_dir.is_dir():
        return {}
    return {path.stem: digest(path.read_text()) for path in sorted(certs_dir.glob("*.pem"))}


def crt_list_text(certs_dir: Path) -> str:
    return "".join(f"{path}\n" for path in sorted(certs_dir.glob("*.pem"))) if certs_dir.is_dir() else ""


def changes(
    wanted: Mapping[str, str], have: Mapping[str, str], certs_dir: Path, crt_list: Path
) -> tuple[list[str], dict[str, str], list[str]]:
    """(runtime commands, name → PEM to write, names to delete) taking ``have`` (name → digest) to
    ``wanted`` (name → PEM). Writes nothing."""
    commands: list[str] = []
    to_write: dict[str, str] = {}
    wanted_safe = {safe_name(name): pem for name, pem in wanted.items()}
    for name, pem in sorted(wanted_safe.items()):
        if have.get(name) == digest(pem):
            continue
        path = certs_dir / f"{name}.pem"
        new = name not in have
        if new:
            commands.append(f"new ssl cert {path}")
        commands += [f"set ssl cert {path} <<\n{pem.strip()}\n\n", f"commit ssl cert {path}"]
        if new:
            commands.append(f"add ssl crt-list {crt_list} {path}")
        to_write[name] = pem
    gone = sorted(have.keys() - wanted_safe.keys())
    for name in gone:
        path = certs_dir / f"{name}.pem"
        commands += [f"del ssl crt-list {crt_list} {path}", f"del ssl cert {path}"]
    return commands, to_write, gone
