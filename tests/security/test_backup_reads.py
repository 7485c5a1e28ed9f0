"""A backup taken with the operator's credential reads every bucket without a consumer (it may not create
one): the console's bucket, which allows no direct read, is read by one message get per key."""

from __future__ import annotations

from shared.backup.cluster import read_console_users
from shared.connection import Connection, connect
from shared.console_users import users_bucket
from shared.security.permissions import Role
from tests.security.conftest import SecureCluster


async def test_the_operator_reads_the_console_bucket_without_a_consumer(
    secure: SecureCluster, control: Connection
) -> None:
    kv = await users_bucket(control.js, create=True)
    assert kv is not None
    await kv.put("user.alice", b'{"name": "alice"}')
    await kv.put("git.endpoint", b"http://127.0.0.1:8090")
    await kv.put("user.gone", b"{}")
    await kv.delete("user.gone")
    operator = await connect(secure.url, name="operator", creds=secure.creds(Role.OPERATOR, "backup"))
    try:
        copy = await read_console_users(operator)
    finally:
        await operator.close()
    assert copy.values == {"user.alice": b'{"name": "alice"}', "git.endpoint": b"http://127.0.0.1:8090"}
    assert copy.revision >= 3
