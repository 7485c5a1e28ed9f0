"""The cluster's local CA: certificates for ``*.localhost`` hosts, which no public CA issues.

Made once per data dir (``<data_dir>/certs/local-ca.pem`` + ``local-ca.key``, the key 0600 from creation;
replicas sharing the dir never each make one: the first link wins), name-constrained to ``localhost`` and
its subdomains. Trust ``local-ca.pem`` in a browser or with ``curl --cacert`` (docs/certificates.md).
Leaves live :data:`LEAF_DAYS` days and are renewed by the loop like any other. :class:`LocalCAFile` reads
the key file again when it changed (``zattera restore`` puts the backed-up CA there): no restart needed.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from shared.files import PRIVATE, create_once
from shared.localca import CA_CERT_FILE, CA_KEY_FILE, parse, publish_cert
from shared.security.tls import new_ca, new_leaf, pem_cert, pem_key

__all__ = ["CA_CERT_FILE", "CA_KEY_FILE", "CA_NAME", "LEAF_DAYS", "LocalCA", "LocalCAFile", "load_or_create"]

log = logging.getLogger(__name__)

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
    material = parse(key_path.read_bytes())
    publish_cert(directory, material)
    return LocalCA(material.cert, material.key)


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class LocalCAFile:
    """The local CA of a directory, read again before an issue when its key file changed (replaced by a
    restore); a key file that cannot be read or parsed keeps the CA in use and is logged."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.current = load_or_create(directory)
        self._stamp = _stamp(directory / CA_KEY_FILE)

    def refresh(self) -> LocalCA:
        """The CA as the directory holds it now."""
        try:
            stamp = _stamp(self.directory / CA_KEY_FILE)
            if stamp != self._stamp:
                ca = load_or_create(self.directory)
                if ca.cert != self.current.cert:
                    log.info("certs: the local CA in %s changed (a restore?): issuing from it now", self.directory)
                self.current, self._stamp = ca, stamp
        except (OSError, ValueError) as exc:
            log.warning("certs: the local CA in %s cannot be read again (%s); keeping it", self.directory, exc)
        return self.current

    def issue(self, hostname: str, now: float) -> tuple[str, bytes]:
        return self.refresh().issue(hostname, now)
