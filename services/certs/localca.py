"""The cluster's local CA: certificates for ``*.localhost`` hosts, which no public CA issues.

Made once per data dir (``<data_dir>/certs/local-ca.pem`` + ``local-ca.key``, the key 0600 from creation;
replicas sharing the dir never each make one: the first link wins), name-constrained to ``localhost`` and
its subdomains. Trust ``local-ca.pem`` in a browser or with ``curl --cacert`` (README,
docs/certificates.md). Leaves live :data:`LEAF_DAYS` days and are renewed by the loop like any other.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shared.secrets import private_temp_file
from shared.security.tls import new_ca, new_leaf, pem_cert, pem_key

CA_CERT_FILE = "local-ca.pem"
CA_KEY_FILE = "local-ca.key"
CA_NAME = "Zattera local CA (localhost)"
LEAF_DAYS = 90


@dataclass(frozen=True)
class LocalCA:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def issue(self, hostname: str, now: float) -> tuple[str, bytes]:
        """(chain PEM, private key PEM) of a fresh leaf for ``hostname``, valid from ``now``."""
        at = datetime.datetime.fromtimestamp(now, datetime.UTC)
        leaf, key = new_leaf(self.cert, self.key, hostname, [hostname], at, days=LEAF_DAYS)
        return pem_cert(leaf), pem_key(key).encode()


def _create_once(path: Path, data: bytes) -> None:
    """Write ``path`` (0600) unless it exists: another replica's wins."""
    tmp = private_temp_file(path, data)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_or_create(directory: Path) -> LocalCA:
    """The local CA of ``directory``, made there the first time."""
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    if not key_path.exists():
        cert, key = new_ca(CA_NAME, datetime.datetime.now(datetime.UTC), permitted_dns="localhost")
        key_pem = pem_key(key).encode()
        _create_once(key_path, key_pem)
        if key_path.read_bytes() == key_pem:  # ours won: its certificate goes with it
            cert_path.unlink(missing_ok=True)
            _create_once(cert_path, pem_cert(cert).encode())
            cert_path.chmod(0o644)  # public: what users trust
    ca_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    return LocalCA(x509.load_pem_x509_certificate(cert_path.read_bytes()), ca_key)
