"""Certificates: the records, the pure decisions of the certificate loop, and the subjects (docs/certificates.md).

A hostname that wants TLS has one ``Certificate`` record (key ``cert.<host>``). Its chain is public; its
private key is sealed (NaCl ``SealedBox``, shared/secrets.py) to the cluster secrets key, so only the
secrets service can open it, and it opens it only for proxies (``zattera.certs.keys.open``), sealed again
to the proxy's fresh in-memory key. The decisions here are pure: the loop feeds them the view and the clock
and commits what they return.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.backoff import exponential
from shared.clock import from_timestamp, to_timestamp
from shared.state.reader import StateReader

KEYS_OPEN_SUBJECT = "zattera.certs.keys.open"
"""Request/reply (secrets service): every servable certificate with its key, sealed to the proxy's key."""
ACCOUNT_OPEN_SUBJECT = "zattera.certs.account.open"
"""Request/reply (secrets service): the ACME account key, sealed to the certificate service's key."""
CHANGED_SUBJECT = "zattera.certs.changed"
"""Core NATS notice (no body) after a certificate is stored or removed: proxies fetch the set again."""
CHALLENGE_PREFIX = "acme."
"""Live-bucket keys ``acme.<token>`` → the HTTP-01 key authorization (while an order is pending)."""
CHALLENGE_PATH = "/.well-known/acme-challenge/"
LOCAL_ISSUER = "local"
ACCOUNT_NAME = "default"

RENEW_FRACTION = 2 / 3
"""Renew once this fraction of the lifetime has passed…"""
JITTER_FRACTION = 0.05
"""…less up to this fraction of the lifetime, spread by hostname so a fleet does not renew in one burst."""
BACKOFF_BASE = 60.0
BACKOFF_MAX = 24 * 3600.0

PENDING = pb.CERTIFICATE_STATE_PENDING
VALID = pb.CERTIFICATE_STATE_VALID
RENEWING = pb.CERTIFICATE_STATE_RENEWING
FAILED = pb.CERTIFICATE_STATE_FAILED

STATE_NAMES = {PENDING: "pending", VALID: "valid", RENEWING: "renewing", FAILED: "failed"}


def is_local_host(hostname: str) -> bool:
    """``localhost`` and its subdomains: no public CA issues for them; the cluster's local CA does."""
    return hostname == "localhost" or hostname.endswith(".localhost")


def renew_at(hostname: str, not_before: float, not_after: float) -> float:
    """Two thirds into the lifetime, less a jitter fixed by the hostname and the expiry (so every replica
    computes the same instant and a renewed certificate gets a fresh one)."""
    lifetime = max(not_after - not_before, 0.0)
    digest = hashlib.sha256(f"{hostname}|{not_after}".encode()).digest()
    spread = int.from_bytes(digest[:4], "big") / float(2**32)
    return not_before + lifetime * RENEW_FRACTION - lifetime * JITTER_FRACTION * spread


def backoff(failures: int, retry_after: float | None) -> float:
    """Seconds before the next order after ``failures`` consecutive failures; the CA's Retry-After wins
    when it asks for longer."""
    wait = exponential(BACKOFF_BASE, max(failures, 1), BACKOFF_MAX)
    return max(wait, retry_after or 0.0)


@dataclass(frozen=True)
class Order:
    """Obtain a certificate for ``hostname`` (``renewal``: one is stored and stays served meanwhile)."""

    hostname: str
    renewal: bool


@dataclass(frozen=True)
class Plan:
    create: tuple[str, ...]  # new PENDING records
    orders: tuple[Order, ...]
    forget: tuple[str, ...]  # hostnames nothing wants any more: their records are deleted
    next_due: float | None  # the earliest instant a record falls due (renewal, retry, or being forgotten)


def due_at(cert: pb.Certificate) -> float:
    """When ``cert`` next needs an order: its retry time after a failure, else its renewal time."""
    retry = from_timestamp(cert.retry_at) if cert.HasField("retry_at") else 0.0
    if not cert.chain_pem:
        return retry
    return max(from_timestamp(cert.renew_at), retry)


FORGET_AFTER = 3600.0
"""Seconds a valid certificate whose name nothing wants any more is kept before its record is deleted. A
name can be unwanted for a while and come back: a restore writes the certificates before the environments
whose routes want them (docs/backup.md), a route snapshot lags its environments. Deleted at once, such a
certificate would be ordered again (from a rate-limited CA, or from a new machine's local CA: another
certificate than the one clients saw). A record with no certificate in it (pending, failed) goes at once."""


def plan(
    wanted: Iterable[str],
    certs: Mapping[str, pb.Certificate],
    now: float,
    unwanted_since: Mapping[str, float] | None = None,
) -> Plan:
    """What the certificate loop does now, given the wanted hostnames and their records by hostname;
    ``unwanted_since``: since when each record's name is not wanted (a name missing from it: for ever),
    a valid certificate is forgotten :data:`FORGET_AFTER` later."""
    want = set(wanted)
    since = unwanted_since or {}
    create = tuple(sorted(want - certs.keys()))
    forget: list[str] = []
    next_due: float | None = None
    for host in sorted(certs.keys() - want):
        kept_until = since.get(host, float("-inf")) + FORGET_AFTER
        if not certs[host].chain_pem or kept_until <= now:
            forget.append(host)
        elif next_due is None or kept_until < next_due:
            next_due = kept_until
    orders = [Order(host, False) for host in create]
    for host in sorted(want & certs.keys()):
        cert = certs[host]
        due = due_at(cert)
        if due <= now:
            orders.append(Order(host, bool(cert.chain_pem)))
        elif next_due is None or due < next_due:
            next_due = due
    return Plan(create, tuple(orders), tuple(forget), next_due)


def pending_record(hostname: str, issuer: str) -> pb.Certificate:
    cert = pb.Certificate(hostname=hostname, state=PENDING, issuer=issuer)
    cert.meta.id = K.cert_id(hostname)
    return cert


@dataclass(frozen=True)
class Issued:
    chain_pem: str
    sealed_key: bytes
    key_id: str


def after_success(current: pb.Certificate, issued: Issued, issuer: str) -> pb.Certificate:
    """The record once a certificate is obtained: the new chain and key, the next renewal instant."""
    from cryptography import x509  # the certs service alone: agents and proxies import this module without it

    leaf = x509.load_pem_x509_certificate(issued.chain_pem.encode())
    not_before = leaf.not_valid_before_utc.timestamp()
    not_after = leaf.not_valid_after_utc.timestamp()
    cert = pb.Certificate()
    cert.CopyFrom(current)
    renewed = bool(current.chain_pem)
    cert.state = VALID
    cert.chain_pem = issued.chain_pem
    cert.sealed_key = issued.sealed_key
    cert.key_id = issued.key_id
    cert.not_before.CopyFrom(to_timestamp(not_before))
    cert.not_after.CopyFrom(to_timestamp(not_after))
    cert.renew_at.CopyFrom(to_timestamp(renew_at(current.hostname, not_before, not_after)))
    cert.ClearField("retry_at")
    cert.failures = 0
    cert.last_error = ""
    cert.issuer = issuer
    cert.renewals = current.renewals + (1 if renewed else 0)
    return cert


def after_failure(current: pb.Certificate, reason: str, retry_after: float | None, now: float) -> pb.Certificate:
    """The record once an order failed: a stored certificate stays (RENEWING, still served), else FAILED;
    the next order waits out the backoff."""
    cert = pb.Certificate()
    cert.CopyFrom(current)
    cert.failures = current.failures + 1
    cert.last_error = reason
    cert.state = RENEWING if current.chain_pem else FAILED
    cert.retry_at.CopyFrom(to_timestamp(now + backoff(cert.failures, retry_after)))
    return cert


def state_name(cert: pb.Certificate, now: float) -> str:
    """The operator's word for a record: a VALID one whose renewal is due reads "renewing"."""
    if cert.state == VALID and cert.chain_pem and from_timestamp(cert.renew_at) <= now:
        return "renewing"
    return STATE_NAMES.get(cert.state, "unknown")


MAX_HOSTNAME = 253
_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def hostname_problem(hostname: str) -> str | None:
    """Why ``hostname`` cannot have a certificate (None: it can): a lower-case DNS name of at least two
    labels (or ``localhost``), no wildcard (HTTP-01 cannot validate one), labels of 1-63 letters, digits
    and inner hyphens, at most 253 characters."""
    if not hostname:
        return "is empty"
    if hostname != hostname.lower():
        return f"{hostname!r} is not lower case"
    if len(hostname) > MAX_HOSTNAME:
        return f"is {len(hostname)} characters; at most {MAX_HOSTNAME}"
    if hostname.startswith("*."):
        return f"{hostname!r} is a wildcard: HTTP-01 validates single names only"
    labels = hostname.split(".")
    if len(labels) < 2 and hostname != "localhost":
        return f"{hostname!r} is not a fully qualified name (expected e.g. www.example.com)"
    for label in labels:
        if not 1 <= len(label) <= 63 or not set(label) <= _LABEL_CHARS or label[0] == "-" or label[-1] == "-":
            return f"{hostname!r}: label {label!r} is not 1-63 letters, digits or inner hyphens"
    return None


@dataclass(frozen=True)
class DomainRow:
    """One line of ``zattera domains list``."""

    hostname: str
    environment: str  # project/app/env, "" for a hostname only the routes want (an implicit one)
    environment_id: str  # "" when no Domain routes it (and the caller's routes do not say)
    state: str
    valid_until: float | None
    renew_at: float | None
    issuer: str
    error: str


def domain_row(
    hostname: str, environment: str, cert: pb.Certificate | None, now: float, environment_id: str = ""
) -> DomainRow:
    if cert is None:
        return DomainRow(hostname, environment, environment_id, "pending", None, None, "", "")
    has_cert = bool(cert.chain_pem)
    return DomainRow(
        hostname,
        environment,
        environment_id,
        state_name(cert, now),
        from_timestamp(cert.not_after) if has_cert else None,
        from_timestamp(cert.renew_at) if has_cert else None,
        cert.issuer,
        cert.last_error,
    )


def domain_rows(
    view: StateReader, now: float, env_label: Callable[[str], str], routed_envs: Mapping[str, str] | None = None
) -> list[DomainRow]:
    """Every hostname with a domain or a certificate, by hostname (``zattera domains list``, the console).
    A Domain names the hostname's env; else ``routed_envs`` (hostname → env id, from the routes) may."""
    certs = {c.hostname: c for c in view.all(K.CERT) if isinstance(c, pb.Certificate)}
    envs = dict(routed_envs or {})
    routed = {d.hostname: d.environment_id for d in view.domains()}
    envs.update(routed)
    rows = []
    for host in sorted(routed.keys() | certs.keys()):
        env_id = envs.get(host, "")
        rows.append(domain_row(host, env_label(env_id) if host in routed else "", certs.get(host), now, env_id))
    return rows


def utc_text(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) if at is not None else "-"


def certificate_text(row: DomainRow) -> str:
    """One line for a hostname's certificate: pending, valid until …, renewing (…), or failed: the CA's reason."""
    if row.state == "valid":
        return f"valid until {utc_text(row.valid_until)} UTC"
    if row.state == "renewing":
        reason = f"; last try: {row.error}" if row.error else ""
        return f"renewing (valid until {utc_text(row.valid_until)} UTC{reason})"
    if row.state == "failed":
        return f"failed: {row.error}" if row.error else "failed"
    return row.state
