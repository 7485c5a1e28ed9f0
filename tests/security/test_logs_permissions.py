"""Instance logs on a secured cluster: an agent ships to an env's log stream, the operator reads it back."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.applogs import LogLimits, app_log_subject, app_logs_stream, app_logs_stream_config, read_app_logs
from shared.connection import Connection, connect
from shared.provisioning import create_or_update_stream
from shared.security.permissions import Role
from tests.security.conftest import SecureCluster

NODE = "n1"


async def test_agent_ships_and_operator_reads_instance_logs(
    secure: SecureCluster, control: Connection, watches: None
) -> None:
    await create_or_update_stream(control.js, app_logs_stream_config("E1", LogLimits(1 << 20, 60.0), 1))
    agent = await connect(secure.url, name="agent", creds=secure.creds(Role.AGENT, NODE))
    operator = await connect(secure.url, name="operator", creds=secure.creds(Role.OPERATOR, "ops"))
    try:
        batch = cpb.InstanceLogBatch(environment_id="E1", instance_id="I1", node_id=NODE)
        batch.lines.add(line="hello", stream="stderr")
        ack = await agent.js.publish(app_log_subject("E1", "I1"), batch.SerializeToString())
        assert ack.stream == app_logs_stream("E1")

        lines = [line async for line in read_app_logs(operator, "E1", last=10, idle=2.0)]
        assert [(line.line, line.stream, line.instance) for line in lines] == [("hello", "stderr", "I1")]
    finally:
        await agent.close()
        await operator.close()
