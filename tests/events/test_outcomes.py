"""Which events a deployment's phase change announces (pure table, no NATS)."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import GREEN_UNHEALTHY, SUPERSEDED, outcome_events
from shared.deploy import CANCELED_BY_OPERATOR

PH = pb.DeploymentPhase
NOW = 1_700_000_000.0


def step(before: int, after: int, *, error: str = "", rollback: bool = False) -> list[tuple[str, str, str]]:
    d = pb.Deployment(phase=before, is_rollback=rollback, release_id="r2", previous_release_id="r1")  # type: ignore[arg-type]
    d.meta.id = "dep1"
    nxt = pb.Deployment()
    nxt.CopyFrom(d)
    nxt.phase = after  # type: ignore[assignment]
    nxt.error = error
    return [(e.kind, e.fields["from_phase"], e.fields["to_phase"]) for e in outcome_events(d, nxt, NOW)]


@pytest.mark.parametrize(
    ("before", "after", "error", "rollback", "expected"),
    [
        (PH.DEPLOYMENT_PHASE_PLACING, PH.DEPLOYMENT_PHASE_STARTING, "", False, []),
        (PH.DEPLOYMENT_PHASE_PROMOTING, PH.DEPLOYMENT_PHASE_DRAINING_OLD, "", False, ["deploy.promoted"]),
        (PH.DEPLOYMENT_PHASE_PROMOTING, PH.DEPLOYMENT_PHASE_DRAINING_OLD, "", True, ["deploy.rolled_back"]),
        (PH.DEPLOYMENT_PHASE_DRAINING_OLD, PH.DEPLOYMENT_PHASE_SUCCEEDED, "", False, ["deploy.succeeded"]),
        (PH.DEPLOYMENT_PHASE_HEALTHCHECKING, PH.DEPLOYMENT_PHASE_FAILED, GREEN_UNHEALTHY, False, ["deploy.failed"]),
        (PH.DEPLOYMENT_PHASE_STARTING, PH.DEPLOYMENT_PHASE_FAILED, CANCELED_BY_OPERATOR, False, ["deploy.canceled"]),
        (PH.DEPLOYMENT_PHASE_PLACING, PH.DEPLOYMENT_PHASE_SUPERSEDED, SUPERSEDED, False, ["deploy.superseded"]),
        # A stateful rollback switches traffic and succeeds in one step: both, from and to the real phases.
        (
            PH.DEPLOYMENT_PHASE_PROMOTING,
            PH.DEPLOYMENT_PHASE_SUCCEEDED,
            "",
            True,
            ["deploy.rolled_back", "deploy.succeeded"],
        ),
    ],
)
def test_outcome_events(before: int, after: int, error: str, rollback: bool, expected: list[str]) -> None:
    events = step(before, after, error=error, rollback=rollback)
    assert [kind for kind, _, _ in events] == expected
    for _, from_phase, to_phase in events:
        assert (from_phase, to_phase) == (PH.Name(before)[17:], PH.Name(after)[17:])  # type: ignore[arg-type]
