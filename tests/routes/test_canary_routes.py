"""Route weights of a canary (issue 41): while a deployment is in its CANARY phase, the env's routes list
both releases' endpoints, each with its release's share (basis points) and the step tag; the weights
follow the deployment record; any other phase is unweighted."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from tests.routes import state as S
from tests.routes.test_builder import IMPLICIT, Routes


def canary(phase: int = pb.DEPLOYMENT_PHASE_CANARY, weight: int = 5, step: int = 0) -> S.Write:
    d = pb.Deployment(
        environment_id="env1",
        release_id="relB",
        previous_release_id="relA",
        phase=phase,  # type: ignore[arg-type]
    )
    d.meta.id = "dep1"
    d.canary.step, d.canary.weight = step, weight
    return K.deployment("dep1"), d


def test_a_canary_weights_both_releases_and_follows_the_step() -> None:
    routes = Routes(
        *S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001), S.healthy_assignment("a2", "relB", 30002)
    )
    assert [e.release_weight for e in routes.route(IMPLICIT).endpoints] == [0]
    assert routes.write(canary()) == {"env1"}
    endpoints = routes.route(IMPLICIT).endpoints
    assert [(e.release_id, e.release_weight, e.step_tag) for e in endpoints] == [
        ("relA", 9500, "dep1.0"),
        ("relB", 500, "dep1.0"),
    ]
    routes.write(canary(weight=25, step=1))
    assert [(e.release_weight, e.step_tag) for e in routes.route(IMPLICIT).endpoints] == [
        (7500, "dep1.1"),
        (2500, "dep1.1"),
    ]
    routes.write(canary(phase=pb.DEPLOYMENT_PHASE_FAILED, weight=25, step=1))
    endpoints = routes.route(IMPLICIT).endpoints
    assert [(e.addr, e.release_id, e.release_weight) for e in endpoints] == [("10.90.0.1:30001", "", 0)]
