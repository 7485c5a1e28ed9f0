"""The web console on a secured cluster: the console (control role) creates its users bucket, an operator adds
users to it, an agent may not write to it."""

from __future__ import annotations

from shared.connection import Connection, connect
from shared.console_users import ADMIN, USERS_BUCKET, load_user, new_user, save_user, user_key, users_bucket
from shared.security.permissions import Role
from tests.security.conftest import ConnectAs, SecureCluster
from tests.security.test_permissions import publish_refused


async def test_operator_adds_console_users_and_an_agent_cannot(
    secure: SecureCluster, control: Connection, connect_as: ConnectAs
) -> None:
    await users_bucket(control.js, create=True)
    operator = await connect(secure.url, name="operator", creds=secure.creds(Role.OPERATOR, "ops"))
    try:
        await save_user(operator.js, new_user("ada", ADMIN, "a long enough password", rounds=4))
    finally:
        await operator.close()
    user = await load_user(control.js, "ada")
    assert user is not None and user.role == ADMIN
    agent = await connect_as(Role.AGENT, "n1")
    subject = f"$KV.{USERS_BUCKET}.{user_key('eve')}"
    await agent.nc.publish(subject, b'{"name": "eve", "role": "admin"}')
    assert await agent.refusal() == publish_refused(subject)
