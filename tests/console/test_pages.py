"""What the pages show, read from a real state view: overview rows, env detail, which env a change touches."""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.console import pages
from shared import keys as K
from shared.state.feed import StateView
from shared.txn import Writer
from shared.urls import Listeners
from tests import factories
from tests.console.rig import ENV_ID, seed
from tests.waiting import eventually


async def test_overview_rows_show_urls_replicas_warmth_and_the_last_deploy(view: StateView, writer: Writer) -> None:
    await seed(writer)
    cold = factories.env("01ENVCOLD", project_id="01PROJ", app_id="01APP", active_release_id="01REL2")
    cold.name, cold.service.scale_to_zero = "staging", True
    idle = factories.env("01ENVIDLE", project_id="01PROJ", app_id="01APP")
    idle.name = "preview"
    replica = factories.assignment("n1", ENV_ID, "01REL2")
    deployment = pb.Deployment(environment_id=ENV_ID, release_id="01REL2", phase=pb.DEPLOYMENT_PHASE_STARTING)
    deployment.meta.id = "01DEP"
    await writer.commit(writer.txn().create(cold).create(idle).create(replica).create(deployment))
    await writer.commit(
        writer.txn().put(pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY), key=K.observed("n1", replica.meta.id))
    )
    routes = cpb.RouteSnapshot(version=3)
    routes.http_routes.add(hostname="shop.example.com", path_prefix="/", environment_id=ENV_ID)
    rows = {row["path"]: row for row in pages.overview(view, routes)}
    production = rows["shop/web/production"]
    assert production["urls"] == ["http://shop.example.com/"]  # no proxy reporting: its port is unknown
    at_proxies = {row["path"]: row for row in pages.overview(view, routes, listeners=Listeners(8080, 8443))}
    assert at_proxies["shop/web/production"]["urls"] == ["http://shop.example.com:8080/"]  # not certified: HTTP
    assert (production["desired"], production["running"], production["healthy"]) == (2, 1, 1)
    assert production["state"] == "warm" and production["last_deploy"]["phase"] == "starting"
    assert production["last_deploy"]["step"] == 5 and not production["last_deploy"]["done"]
    assert rows["shop/web/staging"]["state"] == "cold" and rows["shop/web/preview"]["state"] == "not deployed"
    assert [row["path"] for row in pages.overview(view, routes, only=["01ENVCOLD", "01GONE"])] == ["shop/web/staging"]


async def test_env_detail_offers_rollback_to_older_releases_and_never_secret_values(
    view: StateView, writer: Writer
) -> None:
    await seed(writer)
    env = view.env(ENV_ID)
    assert env is not None
    detail = pages.env_detail(view, env, [], [])
    assert [(r["version"], r["active"], r["can_roll_back_to"]) for r in detail["releases"]] == [
        (2, True, False),
        (1, False, True),
    ]
    assert detail["vars"] == [("GREETING", "hello")] and detail["secrets"] == []
    assert detail["scaling"] | {"effective": 0} == {
        "effective": 0,
        "desired": 2,
        "min": 2,
        "max": 4,
        "scale_to_zero": False,
        "autoscale": False,
    }


async def test_a_change_names_its_env_unless_it_belongs_to_none(view: StateView, writer: Writer) -> None:
    await seed(writer)
    assert pages.changed_envs(view, [(K.ENV, ENV_ID), (K.RELEASE, "01REL1")]) == [ENV_ID]
    assert pages.changed_envs(view, [(K.ENV, ENV_ID), (K.PROJECT, "01PROJ")]) is None  # a rename: every row
    assert pages.changed_envs(view, [(K.DEPLOYMENT, "01GONE")]) is None


async def test_env_detail_shows_each_release_commit(view: StateView, writer: Writer) -> None:
    await seed(writer)
    rel = view.release("01REL2")
    assert rel is not None
    pushed = pb.Release()
    pushed.CopyFrom(rel)
    pushed.source.git_sha = "c" * 40
    pushed.source.git_branch = "main"
    pushed.source.git_author = "Grace Hopper <grace@example.com>"
    pushed.source.git_message = "Fix the orders page\n\nLong body."
    await writer.commit(writer.txn().put(pushed))
    await eventually(lambda: (r := view.release("01REL2")) is not None and bool(r.source.git_sha), what="the put")
    env = view.env(ENV_ID)
    assert env is not None
    newest = pages.env_detail(view, env, [], [])["releases"][0]
    assert (newest["commit"], newest["commit_ref"], newest["author"], newest["message"]) == (
        "c" * 12,
        "main",
        "Grace Hopper <grace@example.com>",
        "Fix the orders page",
    )
