"""The local CA's files in a data dir (``local-ca.key``: key and certificate together, 0600; ``local-ca.pem``:
the public certificate users trust): read and written here for the certs service, which makes the CA and
issues from it, and for backup and restore, which carry it to a new machine (docs/backup.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shared.errors import ZatteraError
from shared.files import PRIVATE, PUBLIC, write_atomic
from shared.security.tls import pem_cert

CA_CERT_FILE = "local-ca.pem"
CA_KEY_FILE = "local-ca.key"


class BadLocalCA(ZatteraError, ValueError):
    """Material that is not a local CA's key and certificate (or whose key does not match the certificate)."""


@dataclass(frozen=True)
class CAMaterial:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def cert_pem(self) -> str:
        return pem_cert(self.cert)


def parse(material: bytes) -> CAMaterial:
    """The key and certificate of a ``local-ca.key`` file's contents; :class:`BadLocalCA` when either is
    missing or they do not belong together."""
    try:
        key = serialization.load_pem_private_key(material, password=None)
        cert = x509.load_pem_x509_certificate(material)
    except ValueError as exc:
        raise BadLocalCA(f"local CA: not a PEM key and certificate ({type(exc).__name__})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise BadLocalCA("local CA: the key does not belong to the certificate")
    return CAMaterial(cert, key)


def read_material(directory: Path) -> bytes | None:
    """The contents of ``directory``'s ``local-ca.key`` (None when the directory has no local CA)."""
    try:
        return (directory / CA_KEY_FILE).read_bytes()
    except FileNotFoundError:
        return None


def publish_cert(directory: Path, ca: CAMaterial) -> None:
    """Rewrite ``local-ca.pem`` when it is not ``ca``'s certificate (public: what users trust)."""
    path = directory / CA_CERT_FILE
    if not path.exists() or path.read_text() != ca.cert_pem:
        write_atomic(path, ca.cert_pem, mode=PUBLIC)


def install(directory: Path, material: bytes) -> CAMaterial:
    """Make ``material`` (checked by :func:`parse`) the local CA of ``directory``: the key file replaced whole
    (0600), then the public certificate. A certs service using the directory issues from it at its next order
    (it reads the key file again when it changed)."""
    ca = parse(material)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(directory / CA_KEY_FILE, material, mode=PRIVATE)
    publish_cert(directory, ca)
    return ca


def directory(data_dir: Path) -> Path:
    """Where the certs service of ``data_dir`` keeps its local CA (``<data>/control/certs`` under ``zattera
    up``)."""
    return data_dir / "certs"


def fingerprint(ca: CAMaterial) -> str:
    """The certificate's SHA-256 fingerprint (public: what an operator compares with a trusted CA)."""
    return ca.cert.fingerprint(hashes.SHA256()).hex(":").upper()
