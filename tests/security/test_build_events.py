"""Build events are attributable on a secured cluster: a builder publishes only under its own node id
(``zattera.builds.<build>.events.<node>``), and the dispatcher takes a build's events only from the node it
assigned the build to (tests/builds/test_dispatcher.py)."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.buildlogs import BuildEventPublisher
from shared.connection import Connection, connect
from shared.security.permissions import Role
from shared.subjects import BUILD_EVENTS_STREAM, build_events_subject
from tests.security.conftest import ConnectAs, SecureCluster
from tests.security.test_permissions import publish_refused


async def test_a_builder_publishes_events_only_under_its_own_node_id(
    secure: SecureCluster, control: Connection, connect_as: ConnectAs
) -> None:
    builder = await connect(secure.url, name="builder", creds=secure.creds(Role.BUILDER, "n2"))
    try:
        await BuildEventPublisher(builder, "B1", "n2").log("own")  # acknowledged: stored
    finally:
        await builder.close()
    stored = await control.js.get_last_msg(BUILD_EVENTS_STREAM, build_events_subject("B1", "n2"))
    assert cpb.BuildEvent.FromString(stored.data or b"").log.line == "own"

    forger = await connect_as(Role.BUILDER, "n2")
    for subject in (build_events_subject("B1", "n1"), "zattera.builds.B1.events", "zattera.builds.B1.log"):
        await forger.nc.publish(subject, cpb.BuildEvent(done=True).SerializeToString())
        assert await forger.refusal() == publish_refused(subject)
    agent = await connect_as(Role.AGENT, "n3")  # not a builder at all
    subject = build_events_subject("B1", "n3")
    await agent.nc.publish(subject, b"")
    assert await agent.refusal() == publish_refused(subject)
