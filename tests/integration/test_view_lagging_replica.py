"""StateView resync on a 3-server cluster whose new ordered consumer lands on a follower still catching up
(restarted after a deploy and its promotion landed without it): the view never shows a mix of the newer
values it had and the older ones of that follower's snapshot, such as a promoted env beside its deployment
still PENDING (``make chaos``, every-role NATS loss)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection, connect
from shared.state.feed import StateView
from shared.subjects import STATE_STREAM
from shared.txn import Txn, Writer
from tests.chaos.cluster import NatsCluster
from tests.orchestrator.failover import invariant_violations
from tests.orchestrator.rig import copied, environment, release, spec
from tests.waiting import eventually

ENV = "web"
LANDED_ON_FOLLOWER = 3
"""Resyncs whose consumer the cluster placed on the lagging follower (about one in three) before the test is
done."""
MAX_TRIES = 40


class CheckedView(StateView):
    """Checks the invariants at every batch boundary it shows while in sync (each batch ends with a lease
    write, as a leader's does: :class:`tests.chaos.cluster.InvariantWatcher`)."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, name="checked")
        self.violations: list[str] = []

    def _notify(self, kind: str, ident: str) -> None:
        super()._notify(kind, ident)
        if kind == K.LEASE and not self.stale:
            self.violations.extend(invariant_violations(self))


def batch_end(txn: Txn, name: str) -> Txn:
    """A batch ends with a lease write; a key of its own, so that each batch delivered again is checked."""
    return txn.put(pb.Lease(holder="test"), key=K.lease(name))


def deployment(deployment_id: str, release_id: str, phase: int) -> pb.Deployment:
    d = pb.Deployment(environment_id=ENV, release_id=release_id, phase=phase)  # type: ignore[arg-type]
    d.meta.id = deployment_id
    return d


async def deploy_and_promote(writer: Writer, i: int) -> str:
    """A deploy (release, PENDING deployment, env re-write) then its promotion (SUCCEEDED with the env's
    active release switched), as two batches like the CLI's and the orchestrator's."""
    view = writer.view
    env = copied(view.env(ENV))
    rel = release(f"{ENV}-r{i:03d}", ENV, f"app:v{i}", spec(1))
    d = deployment(f"{ENV}-d{i:03d}", rel.meta.id, pb.DEPLOYMENT_PHASE_PENDING)
    await writer.commit(batch_end(writer.txn("deploy").create(rel).create(d).put(env), f"deploy-{i}"))
    promoted = copied(view.env(ENV))
    promoted.active_release_id = rel.meta.id
    done = deployment(d.meta.id, rel.meta.id, pb.DEPLOYMENT_PHASE_SUCCEEDED)
    await writer.commit(batch_end(writer.txn("promote").put(done).put(promoted), f"promote-{i}"))
    return rel.meta.id


def shows_active(view: StateView, release_id: str) -> Callable[[], bool]:
    return lambda: (e := view.env(ENV)) is not None and e.active_release_id == release_id


def shows_deployment(view: StateView, deployment_id: str) -> Callable[[], bool]:
    return lambda: view.deployment(deployment_id) is not None


async def consumer_server(view: StateView) -> str:
    info = await view._subs[0].consumer_info()  # where the cluster placed it
    return str(info.cluster.leader) if info.cluster else ""


async def test_a_resync_from_a_lagging_follower_never_shows_a_promoted_env_beside_a_pending_deployment(
    tmp_path: Path,
) -> None:
    nats = NatsCluster(tmp_path / "nats").start()
    conns: list[Connection] = []
    views: list[StateView] = []
    try:
        await nats.provision()
        probe = await connect(nats.urls, name="probe")
        conns.append(probe)
        leader = await nats.stream_leader(probe, STATE_STREAM)
        meta = nats.meta_leader()
        lagging = next(i for i in range(3) if i not in (leader, meta)) if leader != meta else (leader + 1) % 3
        up = nats.servers[leader]  # the clients stay connected to a server that keeps running
        lagging_server = nats.servers[lagging]
        assert lagging_server.pid is not None

        writer_conn = await connect(up.url, name="writer")
        view_conn = await connect(up.url, name="checked")
        conns += [writer_conn, view_conn]
        writer_view = StateView(writer_conn, name="writer")
        view = CheckedView(view_conn)
        views += [writer_view, view]
        await writer_view.start()
        writer = Writer(writer_conn, writer_view)
        s = spec(1)
        seed = writer.txn("seed").put(release(f"{ENV}-r000", ENV, "app:v0", s))
        await writer.commit(seed.put(environment(ENV, s, active=f"{ENV}-r000")))
        await view.start()

        on_follower = 0
        for i in range(1, MAX_TRIES + 1):
            nats.kill(lagging)
            active = await deploy_and_promote(writer, i)
            await eventually(shows_active(view, active), 10)
            nats.restart(lagging)  # serving again at once, its replica still catching up
            await eventually(nats.meta_formed, 10, "the restarted server back in the meta group")
            await asyncio.wait_for(view.force_resync(), 60)
            await eventually(shows_deployment(view, f"{ENV}-d{i:03d}"), 10)
            if await consumer_server(view) == lagging_server.name:
                on_follower += 1
            assert not view.violations, view.violations[:4]
            if on_follower >= LANDED_ON_FOLLOWER:
                break
        assert on_follower >= 1, f"no resync consumer placed on the lagging follower in {MAX_TRIES} tries"
    finally:
        for v in views:
            with contextlib.suppress(Exception):
                await v.stop()
        for c in conns:
            with contextlib.suppress(Exception):
                await c.close()
        nats.stop()
