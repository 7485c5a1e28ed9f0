"""The cluster's local CA: certificates for ``*.localhost`` hosts, which no public CA issues.

Made once per data dir (``<data_dir>/certs/local-ca.pem`` + ``local-ca.key``, the key 0600 from creation;
replicas sharing the dir never each make one: the first link wins), name-constrained to ``localhost`` and
its subdomains. Trust ``local-ca.pem`` in a browser or with ``curl --cacert`` (docs/certificates.md).
Leaves live :data:`LEAF_DAYS` days and are renewed by the loop like any other.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shared.files import PRIVATE, PUBLIC, create_once, write_atomic
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


def load_or_create(directory: Path) -> LocalCA:
    """The local CA of ``directory``, made there the first time. The key file holds the key and the
    certificate together (created in one step, so a replica never pairs one CA's key with another's
    certificate); ``local-ca.pem`` is the public copy of the certificate, rewritten when it differs."""
    key_path = directory / CA_KEY_FILE
    if not key_path.exists():
        cert, key = new_ca(CA_NAME, datetime.datetime.now(datetime.UTC), permitted_dns="localhost")
        create_once(key_path, pem_key(key) + pem_cert(cert), mode=PRIVATE)  # another replica's may win
    material = key_path.read_bytes()
    ca_key = serialization.load_pem_private_key(material, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    cert_pem = pem_cert(x509.load_pem_x509_certificate(material))
    cert_path = directory / CA_CERT_FILE
    if not cert_path.exists() or cert_path.read_text() != cert_pem:
        write_atomic(cert_path, cert_pem, mode=PUBLIC)  # public: what users trust
    return LocalCA(x509.load_pem_x509_certificate(cert_pem.encode()), ca_key)
