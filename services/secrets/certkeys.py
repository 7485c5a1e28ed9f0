"""Opening certificate keys: for proxies (every servable certificate) and for the certificate service (the
ACME account key), each sealed to the requester's fresh key (docs/certificates.md).

Under ``--secure`` only a proxy's credential (and the control plane's) may ask on
``zattera.certs.keys.open``, and only the control plane on ``zattera.certs.account.open``
(shared/security/permissions.py); agents and operators get neither.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.certs import ACCOUNT_NAME
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


def certificate_bundle(view: StateReader, key_for: KeyById) -> cpb.CertBundle:
    """Every stored certificate whose key opens (one that does not is left out and logged by hostname)."""
    bundle = cpb.CertBundle()
    for cert in view.all(K.CERT):
        assert isinstance(cert, pb.Certificate)
        if not cert.chain_pem:
            continue
        key_pem = open_sealed(key_for, cert.key_id, cert.sealed_key)
        if key_pem is None:
            log.warning("certs: the key of %s is sealed to key %s, which is not held", cert.hostname, cert.key_id)
            continue
        entry = bundle.certs.add(hostname=cert.hostname, chain_pem=cert.chain_pem, key_pem=key_pem)
        entry.not_after.CopyFrom(cert.not_after)
    return bundle


def account_bundle(view: StateReader, key_for: KeyById) -> cpb.CertBundle | str:
    account = view.get(K.ACME_ACCOUNT, ACCOUNT_NAME)
    if not isinstance(account, pb.AcmeAccount):
        return "no ACME account is stored"
    key_pem = open_sealed(key_for, account.key_id, account.sealed_key)
    if key_pem is None:
        return f"the ACME account key is sealed to key {account.key_id}, which is not held"
    return cpb.CertBundle(account_key_pem=key_pem)


def answer(request_data: bytes, bundle: Callable[[], cpb.CertBundle | str]) -> cpb.OpenCertKeysResponse:
    try:
        request = cpb.OpenCertKeysRequest.FromString(request_data)
    except Exception:
        return cpb.OpenCertKeysResponse(error="malformed request")
    if len(request.public_key) != 32:
        return cpb.OpenCertKeysResponse(error="public_key: expected 32 bytes (X25519)")
    result = bundle()
    if isinstance(result, str):
        return cpb.OpenCertKeysResponse(error=result)
    return cpb.OpenCertKeysResponse(sealed=seal(request.public_key, result.SerializeToString(deterministic=True)))
