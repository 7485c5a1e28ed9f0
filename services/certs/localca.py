"""The cluster's local CA: certificates for ``*.localhost`` hosts, which no public CA issues.

Made once per data dir (``<data_dir>/certs/local-ca.pem`` + ``local-ca.key``, the key 0600 from creation;
replicas sharing the dir never each make one: the first link wins). Trust ``local-ca.pem`` in a browser
or with ``curl --cacert`` (README, docs/certificates.md). Leaves live :data:`LEAF_DAYS` days and are
renewed by the loop like any other certificate.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.certs.issuer import new_private_key_pem

CA_CERT_FILE = "local-ca.pem"
CA_KEY_FILE = "local-ca.key"
CA_YEARS = 10
LEAF_DAYS = 90
BACKDATE = datetime.timedelta(minutes=5)  # clocks of the machines that check a leaf may lag a little


@dataclass(frozen=True)
class LocalCA:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def issue(self, hostname: str, now: float) -> tuple[str, bytes]:
        """(chain PEM, private key PEM) of a fresh leaf for ``hostname``, valid from ``now``."""
        key_pem = new_private_key_pem()
        leaf_key = serialization.load_pem_private_key(key_pem, password=None)
        assert isinstance(leaf_key, ec.EllipticCurvePrivateKey)
        start = datetime.datetime.fromtimestamp(now, datetime.UTC) - BACKDATE
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)]))
            .issuer_name(self.cert.subject)
            .public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + BACKDATE + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return leaf.public_bytes(serialization.Encoding.PEM).decode(), key_pem


def _new_ca(now: datetime.datetime) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Zattera local CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        # Browsers accept a private root only for the names it is constrained to.
        .add_extension(
            x509.NameConstraints(permitted_subtrees=[x509.DNSName("localhost")], excluded_subtrees=None),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _create_once(path: Path, data: bytes, mode: int) -> None:
    """Write ``path`` unless it exists (another replica's wins), ``mode`` from creation."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def load_or_create(directory: Path) -> LocalCA:
    """The local CA of ``directory``, made there the first time."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    if not key_path.exists():
        cert_pem, key_pem = _new_ca(datetime.datetime.now(datetime.UTC))
        _create_once(key_path, key_pem, 0o600)
        if key_path.read_bytes() == key_pem:  # ours won: its certificate goes with it
            cert_path.unlink(missing_ok=True)
            _create_once(cert_path, cert_pem, 0o644)
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return LocalCA(x509.load_pem_x509_certificate(cert_path.read_bytes()), key)
