"""A local certificate authority and the embedded server's certificate (``zattera up --tls``).

ECDSA P-256: supported by Go's TLS (nats-server) and OpenSSL alike, and cheap to generate on a small machine.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.security.creds import write_private

CA_DAYS = 3650
SERVER_DAYS = 825  # the longest validity clients commonly accept for a leaf certificate


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    def server_config(self) -> str:
        """The nats-server ``tls`` block: clients must use TLS; they authenticate with credentials, not certs."""
        return f'tls {{ cert_file: "{self.cert}", key_file: "{self.key}", timeout: 5 }}\n'

    def route_config(self) -> str:
        """The ``cluster { tls {…} }`` block: routes use TLS and each side verifies the other's certificate
        against the cluster CA (mutual TLS: a server without a certificate of this CA cannot open a route)."""
        return (
            f'tls {{ cert_file: "{self.cert}", key_file: "{self.key}", ca_file: "{self.ca}", '
            "verify: true, timeout: 5 }\n"
        )


def default_hosts() -> list[str]:
    return ["localhost", "127.0.0.1", "::1", socket.gethostname()]


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Zattera"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


BACKDATE = datetime.timedelta(minutes=5)  # the clocks of the machines that check a certificate may lag a little


def self_signed(
    common_name: str, now: datetime.datetime, days: int
) -> tuple[x509.CertificateBuilder, ec.EllipticCurvePrivateKey]:
    """A new P-256 key and a certificate naming ``common_name`` as subject and issuer, valid from a little
    before ``now`` for ``days``: signed with the key as it is (a self-signed leaf), or with extensions (a CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
    )
    return builder, key


def new_ca(
    common_name: str, now: datetime.datetime, *, days: int = CA_DAYS, permitted_dns: str = ""
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA (may sign leaves only); ``permitted_dns`` constrains it to that domain and its
    subdomains (browsers trust a private root only that far)."""
    builder, key = self_signed(common_name, now, days)
    builder = (
        builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
    )
    if permitted_dns:
        builder = builder.add_extension(
            x509.NameConstraints(permitted_subtrees=[x509.DNSName(permitted_dns)], excluded_subtrees=None),
            critical=True,
        )
    return builder.sign(key, hashes.SHA256()), key


def new_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    hosts: list[str],
    now: datetime.datetime,
    days: int = SERVER_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server certificate for ``hosts`` (DNS names or IP addresses) signed by ``ca_cert``; also a client
    certificate, which a server presents on the routes it opens (verified by the other side)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def generate(directory: Path, hosts: list[str] | None = None) -> TlsFiles:
    """Create ``ca.pem`` (+ ``ca-key.pem``) and ``server.pem``/``server-key.pem`` for ``hosts``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_cert, ca_key = new_ca("Zattera local CA", now)
    server_cert, server_key = new_leaf(ca_cert, ca_key, "zattera-nats", hosts or default_hosts(), now)
    files = TlsFiles(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server-key.pem")
    write_private(directory / "ca-key.pem", pem_key(ca_key))
    write_private(files.key, pem_key(server_key))
    write_private(files.cert, pem_cert(server_cert))
    write_private(files.ca, pem_cert(ca_cert))
    return files


def issue_server(directory: Path, hosts: list[str]) -> TlsFiles:
    """A new server certificate for ``hosts`` signed by the CA already in ``directory`` (a joining server
    machine's, for its own addresses); the CA is kept."""
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca-key.pem'}: not an EC key")
    now = datetime.datetime.now(datetime.UTC)
    cert, key = new_leaf(ca_cert, ca_key, "zattera-nats", hosts, now)
    files = TlsFiles(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server-key.pem")
    write_private(files.key, pem_key(key))
    write_private(files.cert, pem_cert(cert))
    return files


def load_or_generate(directory: Path, hosts: list[str] | None = None) -> TlsFiles:
    files = TlsFiles(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server-key.pem")
    if files.ca.exists() and files.cert.exists() and files.key.exists():
        return files
    if files.ca.exists() and (directory / "ca-key.pem").exists():
        return issue_server(directory, hosts or default_hosts())  # a joining server machine: the cluster's CA
    return generate(directory, hosts)
