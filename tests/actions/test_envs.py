"""Scaling and deleting environments (shared/actions/envs.py, deletion.py): the pure rules as tables on a
MemoryState, the commits and their events on real NATS."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext
from shared.actions.deletion import Delete, Scope, delete, deletion_txn, plan_delete, plan_deletion
from shared.actions.envs import Scale, decide_scale, scale, scaled
from shared.actions.refusals import Invalid, NotFound, Refusal
from shared.connection import Connection
from shared.state.feed import StateView
from shared.txn import Conflict, Writer
from tests.actions.conftest import ACTOR, ENV_ID, PATH, named
from tests.eventlog import wait_for_kinds
from tests.factories import assignment
from tests.memory_state import MemoryState


def _env(*, lo: int, hi: int, effective: int = 0, s2z: bool = False) -> pb.Environment:
    e = pb.Environment(effective_replicas=effective, active_release_id="rel1")
    e.service.replicas.min, e.service.replicas.max = lo, hi
    e.service.scale_to_zero = s2z
    return e


@pytest.mark.parametrize(
    ("env", "request_", "expected"),
    [
        pytest.param(_env(lo=2, hi=4), (3, None, None), (3, 3, 3), id="fixed_count"),
        pytest.param(_env(lo=2, hi=4, effective=3), (None, 1, 6), (1, 6, 3), id="bounds_keep_the_count"),
        pytest.param(_env(lo=2, hi=4, effective=4), (None, None, 2), (2, 2, 2), id="count_clamped_into_bounds"),
        pytest.param(_env(lo=1, hi=3), (None, 2, None), (2, 3, 2), id="raising_min_raises_the_count"),
        pytest.param(_env(lo=1, hi=2, effective=1, s2z=True), (0, None, None), (1, 2, 0), id="s2z_zero_cools_now"),
        pytest.param(_env(lo=1, hi=2, s2z=True), (None, 1, 5), (1, 5, 0), id="cold_s2z_stays_cold"),
        pytest.param(_env(lo=2, hi=4), (0, None, None), (0, 0, 0), id="zero_stops_a_plain_env"),
    ],
)
def test_scale_sets_bounds_and_count(
    env: pb.Environment, request_: tuple[int | None, int | None, int | None], expected: tuple[int, int, int]
) -> None:
    new = scaled(env, Scale("e", *request_))
    assert (new.service.replicas.min, new.service.replicas.max, new.effective_replicas) == expected


@pytest.mark.parametrize(
    ("request_", "field", "message"),
    [
        (Scale(PATH, None, 3, 2), "maximum", "--max: max 2 is below min 3"),
        (Scale(PATH, 5, None, 3), "replicas", "REPLICAS 5: outside --min 2 / --max 3"),
        (Scale(PATH, None, -1, None), "minimum", "--min -1: must be 0 or more"),
        (Scale(PATH), "replicas", "give REPLICAS (a fixed count) or --min/--max (the autoscaling bounds)"),
    ],
)
def test_bad_scale_requests_are_refused_naming_the_option(request_: Scale, field: str, message: str) -> None:
    state = MemoryState(*named())
    with pytest.raises(Invalid) as refused:
        request_.check()
        decide_scale(state.store, request_, 0.0)
    assert (refused.value.kind, refused.value.field, str(refused.value)) == (Refusal.INVALID, field, message)


def test_an_unknown_env_is_not_found_about_the_env_field() -> None:
    with pytest.raises(NotFound) as refused:
        decide_scale(MemoryState(*named()).store, Scale("shop/web/nope", 3), 0.0)
    assert refused.value.field == "env"
    assert (
        refused.value.said_as({"env": "--env"})
        == "--env: no environment 'shop/web/nope' (use an id or project/app/env)"
    )


async def test_scale_commits_and_announces_who_scaled(ctx: ActionContext, conn: Connection, writer: Writer) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    done = await scale(ctx, Scale(PATH, 3))
    assert (done.env_id, done.env, done.replicas, done.minimum, done.maximum) == (ENV_ID, PATH, 3, 3, 3)
    env = ctx.view.env(ENV_ID)
    assert env is not None and (env.service.replicas.min, env.effective_replicas) == (3, 3)
    [event] = [e for e in await wait_for_kinds(conn, "env.scaled") if e.kind == "env.scaled"]
    assert (event.environment_id, event.fields["actor"], event.message) == (ENV_ID, ACTOR, done.message)
    assert done.message == f"scaled {PATH} to 3 replica(s) (min 3, max 3)"


@pytest.mark.parametrize("scope", list(Scope))
def test_a_deletion_is_planned_by_id_or_by_name(scope: Scope) -> None:
    state = MemoryState(*named(), assignment("n1", ENV_ID, "rel1", assignment_id="run-1"))
    refs = {Scope.ENV: (ENV_ID, PATH), Scope.APP: ("01APP", "shop/web"), Scope.PROJECT: ("01PROJ", "shop")}[scope]
    for ref in refs:
        plan = plan_delete(state.store, Delete(scope, ref), now=1.0)
        assert plan is not None and [e.meta.id for e in plan.envs] == [ENV_ID]
        assert [a.desired for a in plan.stops] == [pb.ASSIGNMENT_DESIRED_STOP]
    assert plan_delete(state.store, Delete(scope, "nope"), now=1.0) is None


async def test_delete_commits_the_plan_and_announces_it_with_the_actor(
    ctx: ActionContext, conn: Connection, writer: Writer
) -> None:
    await writer.commit(writer.txn().extend(creates=named()))
    done = await delete(ctx, Delete(Scope.APP, "shop/web"))
    assert done.what == "app shop/web" and done.counts["environments"] == 1 and done.counts["apps"] == 1
    assert ctx.view.env(ENV_ID) is None and ctx.view.app("01APP") is None and ctx.view.project("01PROJ") is not None
    events = await wait_for_kinds(conn, "app.deleted", "env.deleted")
    assert {e.kind: e.fields["actor"] for e in events} == {"app.deleted": ACTOR, "env.deleted": ACTOR}
    with pytest.raises(NotFound, match=r"^app 'shop/web': not found$"):
        await delete(ctx, Delete(Scope.APP, "shop/web"))


async def test_a_deletion_is_one_fenced_batch_refused_whole_by_a_concurrent_write(
    conn: Connection, view: StateView, writer: Writer
) -> None:
    """A deploy re-writes its env; the deletion decided before it must not commit (nothing deleted)."""
    await writer.commit(writer.txn().extend(creates=named()))
    app = view.app("01APP")
    assert app is not None
    txn = deletion_txn(writer, plan_deletion(view, "app shop/web", apps=[app], now=0.0))
    other = StateView(conn, name="deployer")
    await other.start()
    env = pb.Environment()
    env.CopyFrom(other.env(ENV_ID))  # type: ignore[arg-type]
    env.effective_replicas = 3  # any write to the env: a deploy, a promotion, a scaling decision
    await Writer(conn, other).commit(Writer(conn, other).txn().put(env))
    await other.stop()
    with pytest.raises(Conflict):
        await writer.commit(txn)
    assert view.env(ENV_ID) is not None and view.app("01APP") is not None and view.get(K.PROJECT, "01PROJ")
