"""A single write sent while the state stream's leader is lost (its server stopped answering: a machine lost
with its link cut) lands once the survivors have elected a new leader — sent again, not waited out on a reply
that never comes — and is stored once. Real three-server cluster; the lost server is stopped with SIGSTOP."""

from __future__ import annotations

import os
import signal

from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX, STATE_STREAM
from shared.txn import Writer
from tests.factories import node
from tests.waiting import eventually


async def leader_of_state(conn: Connection) -> str:
    info = await conn.js.stream_info(STATE_STREAM)
    return info.cluster.leader if info.cluster and info.cluster.leader else ""


async def test_a_write_sent_while_the_state_leader_is_lost_lands_after_the_election_once(
    stoppable_cluster: list[EmbeddedNats],
) -> None:
    setup = await connect(",".join(s.url for s in stoppable_cluster), name="setup")
    try:
        await provision(setup.js, replicas=3, tombstone_ttl=900)
        leaders: list[str] = []

        async def led() -> bool:  # the same leader twice running: a new stream's first leader may still move
            leaders.append(await leader_of_state(setup))
            return len(leaders) > 1 and leaders[-1] == leaders[-2] != ""

        await eventually(led, timeout=30, what="a state stream leader, the same at two reads")
    finally:
        await setup.close()
    lost = next(s for s in stoppable_cluster if s.name == leaders[-1])
    survivor = next(s for s in stoppable_cluster if s is not lost)
    conn = await connect(survivor.url, name="writer")  # a survivor's client, as the CLI on another machine
    view = StateView(conn, name="writer")
    await view.start()
    try:
        writer = Writer(conn, view, commit_timeout=25.0)
        assert lost.pid is not None
        assert await leader_of_state(conn) == lost.name, "the leader moved before it was stopped"
        os.kill(lost.pid, signal.SIGSTOP)  # its routes stay open; nothing sent to it is answered
        await writer.commit(writer.txn().create(node("n1")))
        assert writer.resent >= 1  # the first send reached no leader
        stored = await conn.js.stream_info(STATE_STREAM, subjects_filter=f"{STATE_PREFIX}node.n1")
        assert stored.state.subjects == {f"{STATE_PREFIX}node.n1": 1}
    finally:
        await view.stop()
        await conn.close()
