"""Opening certificate keys: for proxies (every servable certificate) and for the certificate service (the
ACME account key), each sealed to the requester's fresh key (docs/certificates.md).

Under ``--secure`` only a proxy's credential (and the control plane's) may ask on
``zattera.certs.keys.open``, and only the control plane on ``zattera.certs.account.open``
(shared/security/permissions.py); agents and operators get neither.

The certificate set comes in pages (issue 42): one NATS message holds at most the connection's
``max_payload`` (8 MiB on the embedded server, 1 MiB on a default nats-server), about 8,000 P-256
certificates at best, so :func:`answer_page` answers the hostnames after the request's ``after``, in hostname
order, as many as fit, and says ``more`` with ``next_after``. A request without ``paged`` (a proxy from before
paging) gets the whole set in one answer, or an error when it does not fit: a first page alone would be
taken as the whole set and the proxy would drop every certificate on the later pages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nacl.bindings import crypto_box_SEALBYTES
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.certs import ACCOUNT_NAME, MAX_HOSTNAME
from shared.secrets import seal, unseal
from shared.state.reader import StateReader

log = logging.getLogger(__name__)

KeyById = Callable[[str], PrivateKey | None]


def open_sealed(key_for: KeyById, key_id: str, ciphertext: bytes) -> str | None:
    key = key_for(key_id)
    if key is None:
        return None
    try:
        return unseal(key, ciphertext).decode()
    except (CryptoError, UnicodeDecodeError):
        return None


HEADER_ROOM = 4096
"""Bytes of a page's message kept free for NATS headers (none are sent today; a tracing layer may add some)."""
MIN_PAGE_BYTES = 64 * 1024
"""The smallest ``max_bytes`` a requester may name (a smaller one is refused, naming the field)."""
_MORE_BYTES = 3  # CertBundle.more = true: tag of field 50 (2 bytes) + 1
_NEXT_AFTER_MAX = 2 + 2 + MAX_HOSTNAME  # CertBundle.next_after: tag of field 51, length, a hostname at most


def varint_size(value: int) -> int:
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def field_size(payload: int) -> int:
    """Bytes of a length-delimited field numbered below 16 (tag 1 byte) carrying ``payload`` bytes."""
    return 1 + varint_size(payload) + payload


def sealed_response_size(plaintext: int) -> int:
    """Bytes of an :class:`OpenCertKeysResponse` whose ``sealed`` holds ``plaintext`` bytes: a sealed box adds
    ``crypto_box_SEALBYTES`` (48: the sender's one-time public key, 32, and the MAC, 16)."""
    return field_size(plaintext + crypto_box_SEALBYTES)


def page_limit(server_max: int, requested: int) -> int:
    """Bytes a page's whole message may take: the smaller of both connections' ``max_payload``."""
    return min(server_max, requested) if requested else server_max


def certificate_page(view: StateReader, key_for: KeyById, after: str, limit: int) -> cpb.CertBundle:
    """The servable certificates whose hostname sorts after ``after``, in hostname order, as many as fit a
    message of ``limit`` bytes with :data:`HEADER_ROOM` to spare; ``more``/``next_after`` when some are left.
    A certificate too large for any page is left out and logged by hostname (never its key)."""
    budget = limit - HEADER_ROOM
    fixed = _MORE_BYTES + _NEXT_AFTER_MAX
    page = cpb.CertBundle()
    body = 0
    last = after
    records = sorted(
        (c for c in view.all(K.CERT) if isinstance(c, pb.Certificate) and c.chain_pem and c.hostname > after),
        key=lambda c: c.hostname,
    )
    for cert in records:
        key_pem = open_sealed(key_for, cert.key_id, cert.sealed_key)
        if key_pem is None:
            log.warning("certs: the key of %s is sealed to key %s, which is not held", cert.hostname, cert.key_id)
            last = cert.hostname
            continue
        entry = cpb.CertEntry(hostname=cert.hostname, chain_pem=cert.chain_pem, key_pem=key_pem)
        entry.not_after.CopyFrom(cert.not_after)
        size = field_size(entry.ByteSize())
        if sealed_response_size(size + fixed) > budget:
            log.warning("certs: the certificate of %s (%d bytes) fits no page of %d bytes", cert.hostname, size, limit)
            last = cert.hostname
            continue
        if sealed_response_size(body + size + fixed) > budget:
            page.more, page.next_after = True, last
            break
        page.certs.append(entry)
        body += size
        last = cert.hostname
    return page


def _request(request_data: bytes) -> cpb.OpenCertKeysRequest | cpb.OpenCertKeysResponse:
    """The request on ``zattera.certs.keys.open``, or the answer refusing it (malformed, no X25519 key)."""
    try:
        request = cpb.OpenCertKeysRequest.FromString(request_data)
    except Exception:
        return cpb.OpenCertKeysResponse(error="malformed request")
    if len(request.public_key) != 32:
        return cpb.OpenCertKeysResponse(error="public_key: expected 32 bytes (X25519)")
    return request


def answer_page(request_data: bytes, view: StateReader, key_for: KeyById, server_max: int) -> cpb.OpenCertKeysResponse:
    """The answer on ``zattera.certs.keys.open``: one page (``paged``) or the whole set (an older proxy)."""
    request = _request(request_data)
    if isinstance(request, cpb.OpenCertKeysResponse):
        return request
    if request.max_bytes and request.max_bytes < MIN_PAGE_BYTES:
        return cpb.OpenCertKeysResponse(error=f"max_bytes: at least {MIN_PAGE_BYTES} (got {request.max_bytes})")
    limit = page_limit(server_max, request.max_bytes)
    page = certificate_page(view, key_for, request.after, limit)
    if page.more and not request.paged:
        return cpb.OpenCertKeysResponse(
            error=f"the certificate set does not fit one message of {limit} bytes: this proxy must read pages "
            "(upgrade it); it keeps the certificates it has"
        )
    response = cpb.OpenCertKeysResponse(sealed=seal(request.public_key, page.SerializeToString(deterministic=True)))
    if response.ByteSize() > limit - HEADER_ROOM:  # the computed sizes above make this unreachable
        return cpb.OpenCertKeysResponse(error=f"a page outgrew its computed size ({response.ByteSize()} bytes)")
    return response


def account_bundle(view: StateReader, key_for: KeyById) -> cpb.CertBundle | str:
    account = view.get(K.ACME_ACCOUNT, ACCOUNT_NAME)
    if not isinstance(account, pb.AcmeAccount):
        return "no ACME account is stored"
    key_pem = open_sealed(key_for, account.key_id, account.sealed_key)
    if key_pem is None:
        return f"the ACME account key is sealed to key {account.key_id}, which is not held"
    return cpb.CertBundle(account_key_pem=key_pem)


def answer(request_data: bytes, bundle: Callable[[], cpb.CertBundle | str]) -> cpb.OpenCertKeysResponse:
    request = _request(request_data)
    if isinstance(request, cpb.OpenCertKeysResponse):
        return request
    result = bundle()
    if isinstance(result, str):
        return cpb.OpenCertKeysResponse(error=result)
    return cpb.OpenCertKeysResponse(sealed=seal(request.public_key, result.SerializeToString(deterministic=True)))
