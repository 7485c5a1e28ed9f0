"""The proxy's certificate client without the control plane: it serves its 0600 cache, keeps it while the
secrets service does not answer, and starts empty (not failing) from an unreadable cache."""

from __future__ import annotations

import stat
from dataclasses import asdict
from pathlib import Path

import pytest

from shared.certclient import CACHE_FILE, CertClient, CertsUnavailable, ServedCert
from shared.connection import Connection
from shared.files import write_private_json

CERT = ServedCert("a.example.com", "-----BEGIN CERTIFICATE-----\n", "-----BEGIN PRIVATE KEY-----\n", 4e9)


async def test_the_cache_is_served_and_kept_while_nobody_answers(conn: Connection, tmp_path: Path) -> None:
    path = tmp_path / "proxy" / CACHE_FILE
    write_private_json(path, {"certs": {CERT.hostname: asdict(CERT)}})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    client = CertClient(path)
    assert dict(client.current) == {CERT.hostname: CERT}
    await client.start(conn)
    try:
        updates = client.updates()
        assert dict(await anext(updates)) == {CERT.hostname: CERT}
        with pytest.raises(CertsUnavailable, match="did not answer"):  # no secrets service runs
            await client.fetch()
        assert dict(client.current) == {CERT.hostname: CERT} and client.version == 0
    finally:
        await client.stop()


def test_an_unreadable_cache_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / CACHE_FILE
    path.write_text("{not json")
    assert dict(CertClient(path).current) == {}
