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
import logging
import os
import re
import secrets
import ssl
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from shared.security.creds import write_private

log = logging.getLogger(__name__)

FALLBACK_NAME = "zattera-ingress"
FALLBACK_DAYS = 3650
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.DOTALL)
_PRIVATE_KEY = re.compile(rb"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.*?-----END \1PRIVATE KEY-----", re.DOTALL)


def safe_name(name: str) -> str:
    return _UNSAFE.sub("_", name) or "_"


def digest(pem: str) -> str:
    return hashlib.sha256(pem.encode()).hexdigest()


def self_signed_pem(common_name: str = FALLBACK_NAME) -> str:
    """A self-signed ECDSA P-256 certificate and its key, in one PEM."""
    # In the child of :func:`ensure_fallback`: the proxy itself never loads cryptography.
    from cryptography.hazmat.primitives import hashes

    from shared.security.tls import pem_cert, pem_key, self_signed

    builder, key = self_signed(common_name, datetime.datetime.now(datetime.UTC), FALLBACK_DAYS)
    return pem_cert(builder.sign(key, hashes.SHA256())) + pem_key(key)


def _no_password() -> bytes:
    return b""  # an encrypted key fails to load instead of OpenSSL prompting on a terminal


def pem_problem(pem: str, scratch: Path) -> str | None:
    """Why HAProxy would refuse ``pem`` (no certificate, no private key, a key that does not match), or
    None (:class:`PemChecker`, for one PEM)."""
    return PemChecker(scratch).problem(pem)


class PemChecker:
    """Checks PEMs before anything is written: a bad file in the crt-list would stop HAProxy from starting.
    OpenSSL checks each as HAProxy will (through :mod:`ssl`, which reads a key only from a file: a 0600 file
    in the private directory ``scratch``, removed at once). One OpenSSL context is made once and reused for
    every PEM (making one is ~0.4 ms with OpenSSL 3: half a check, when 10,000 certificates arrive at once);
    the certificates alone are parsed again only to name what is wrong with a PEM it refused. Not
    thread-safe: one checker per thread."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def problem(self, pem: str) -> str | None:
        data = pem.encode()
        certificates = _CERTIFICATE.findall(pem)
        if not certificates:
            return "no PEM certificate in it"
        if _PRIVATE_KEY.search(data) is None:
            return "no PEM private key in it" if _parse(certificates) else "no PEM certificate in it"
        path = self.scratch / f".check-{secrets.token_hex(8)}.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            self._context.load_cert_chain(path, password=_no_password)  # the chain, the key, that they match
        except ssl.SSLError as exc:
            if not _parse(certificates):
                return "no PEM certificate in it"
            if exc.reason == "KEY_VALUES_MISMATCH":
                return "its private key does not match its first certificate"
            return "its private key cannot be read (encrypted or malformed)"
        finally:
            path.unlink(missing_ok=True)
        return None


def _parse(certificates: list[str]) -> bool:
    """Whether OpenSSL reads every one of ``certificates`` (PEM blocks)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata="\n".join(certificates))
    except ssl.SSLError:
        return False
    return True


def ensure_fallback(path: Path) -> None:
    """The fallback certificate, made once in a short-lived child: the cryptography library it takes
    (~7 MB resident) stays out of the long-running proxy."""
    if path.exists():
        return
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from services.proxy.haproxy_certs import self_signed_pem as s; sys.stdout.write(s())",
        ],
        capture_output=True,
        check=True,
        text=True,
        timeout=60,
    )
    write_private(path, made.stdout)


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


def changed_names(pems: Mapping[str, str], have: Mapping[str, str]) -> list[str]:
    """(In a thread.) The names in ``pems`` whose PEM HAProxy does not hold, sorted."""
    return sorted(name for name, pem in pems.items() if have.get(safe_name(name)) != digest(pem))


def usable_pems(pems: Mapping[str, str], have: Mapping[str, str], scratch: Path) -> dict[str, str]:
    """(In a thread.) ``pems`` without those HAProxy would refuse (logged). Only new and changed PEMs are
    checked: parsing 10,000 served ones took seconds per renewal."""
    checker = PemChecker(scratch)
    usable = {}
    for name, pem in pems.items():
        problem = None if have.get(safe_name(name)) == digest(pem) else checker.problem(pem)
        if problem is None:
            usable[name] = pem
        else:
            log.warning("haproxy: certificate %s not served: %s", name, problem)
    return usable
