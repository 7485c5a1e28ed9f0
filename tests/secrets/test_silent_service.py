"""No secrets service answering is told apart from a refusal: an agent asks again (a control plane still
starting, or restarting for an upgrade) instead of counting a failed start of the app."""

from __future__ import annotations

import pytest
from nacl.public import PrivateKey

from shared.connection import Connection
from shared.secrets import SecretsServiceSilent, SecretsUnavailable, fetch_secrets


async def test_a_secrets_request_nobody_answers_is_silence_not_a_refusal(conn: Connection) -> None:
    with pytest.raises(SecretsServiceSilent, match="the secrets service did not answer") as raised:
        await fetch_secrets(conn, "n1", PrivateKey.generate(), "A1", timeout=0.5)
    assert isinstance(raised.value, SecretsUnavailable)  # callers that only know the refusal still catch it
