"""TLS on the NATS listener: clients must verify the server against the generated CA."""

from __future__ import annotations

import ssl
from pathlib import Path

import nats
import pytest

from shared.connection import connect
from shared.embedded import EmbeddedNats
from shared.security.setup import prepare


async def test_a_client_must_trust_the_generated_ca(tmp_path: Path) -> None:
    setup = prepare(tmp_path / "security", tls=True)
    assert setup.tls_ca is not None
    server = EmbeddedNats(data_dir=tmp_path / "nats", extra_config=setup.server_config()).start()
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
            await nats.connect(
                server.url,
                user_credentials=str(setup.control_creds),
                tls=ssl.create_default_context(),  # the system CAs only
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
            )

        conn = await connect(server.url, name="tls", creds=str(setup.control_creds), tls_ca=str(setup.tls_ca))
        try:
            assert conn.nc.is_connected
        finally:
            await conn.close()
    finally:
        server.stop()
