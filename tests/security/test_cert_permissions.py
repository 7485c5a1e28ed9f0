"""Under --secure: proxies get certificate keys and HTTP-01 answers; the ACME account key is the control
plane's only; agents and operators get neither."""

from __future__ import annotations

import pytest

from shared.acmechallenge import ChallengeAnswers, publish_answer
from shared.certs import ACCOUNT_OPEN_SUBJECT, CHANGED_SUBJECT, KEYS_OPEN_SUBJECT
from shared.connection import Connection, connect
from shared.security.permissions import Role
from tests.security.conftest import ConnectAs, SecureCluster
from tests.security.test_permissions import publish_refused


async def test_a_proxy_reads_http01_answers_without_a_consumer(secure: SecureCluster, control: Connection) -> None:
    proxy = await connect(secure.url, name="proxy", creds=secure.creds(Role.PROXY, "p1"))
    answers = ChallengeAnswers()
    try:
        await answers.start(proxy)
        await proxy.nc.subscribe(CHANGED_SUBJECT)
        await proxy.nc.flush()
        await publish_answer(control, "tok-1", "tok-1.thumbprint")
        await publish_answer(control, "tok-2", "tok-2.thumbprint")
        assert await answers.lookup("/.well-known/acme-challenge/tok-2") == "tok-2.thumbprint"
        assert await answers.lookup("/.well-known/acme-challenge/tok-1") == "tok-1.thumbprint"
        assert await answers.lookup("/.well-known/acme-challenge/tok-3") is None
    finally:
        await answers.stop()
        await proxy.close()


async def test_a_proxy_may_request_certificate_keys(connect_as: ConnectAs) -> None:
    proxy = await connect_as(Role.PROXY, "p1")
    await proxy.nc.publish(KEYS_OPEN_SUBJECT, b"", reply=proxy.nc.new_inbox())
    await proxy.nc.flush()
    assert not proxy.errors


@pytest.mark.parametrize(
    ("role", "subject"),
    [
        (Role.PROXY, ACCOUNT_OPEN_SUBJECT),
        (Role.AGENT, ACCOUNT_OPEN_SUBJECT),
        (Role.AGENT, KEYS_OPEN_SUBJECT),
        (Role.OPERATOR, KEYS_OPEN_SUBJECT),
        (Role.OPERATOR, ACCOUNT_OPEN_SUBJECT),
    ],
)
async def test_others_cannot_ask_for_keys(connect_as: ConnectAs, role: Role, subject: str) -> None:
    client = await connect_as(role, "n1")
    await client.nc.publish(subject, b"")
    assert await client.refusal() == publish_refused(subject)
