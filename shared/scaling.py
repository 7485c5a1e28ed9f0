"""Scaling an environment by hand: the decision ``zattera scale`` and the web console share."""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.deployments import desired_replicas


@dataclass(frozen=True, slots=True)
class ScaleRequest:
    """What ``zattera scale`` was asked (None: not given)."""

    replicas: int | None
    minimum: int | None
    maximum: int | None

    def problem(self) -> str | None:
        """What is wrong with the request, naming the option (None: nothing), before anything is read."""
        if self.replicas is None and self.minimum is None and self.maximum is None:
            return "give REPLICAS (a fixed count) or --min/--max (the autoscaling bounds)"
        for option, value in (("REPLICAS", self.replicas), ("--min", self.minimum), ("--max", self.maximum)):
            if value is not None and value < 0:
                return f"{option} {value}: must be 0 or more"
        return None


def scaled(env: pb.Environment, request: ScaleRequest) -> pb.Environment:
    """The env with its replica bounds and count set as asked; raises ValueError naming the option.

    REPLICAS alone is a fixed count (min = max = N: the autoscaler has no room); --min/--max set the
    bounds the autoscaler moves within (with REPLICAS: the count to start from, inside them), and the
    current count is brought inside them. A cold
    scale-to-zero env stays cold (its next request wakes it within the new bounds); REPLICAS 0 on one
    cools it now without touching its bounds.
    """
    new = pb.Environment()
    new.CopyFrom(env)
    spec = new.service.replicas
    cold_s2z = env.service.scale_to_zero and env.effective_replicas == 0
    if request.replicas == 0 and env.service.scale_to_zero and request.minimum is None and request.maximum is None:
        new.effective_replicas = 0
        return new
    fixed = request.minimum is None and request.maximum is None
    if fixed:
        spec.min = spec.max = request.replicas or 0
    if request.minimum is not None:
        spec.min = request.minimum
    if request.maximum is not None:
        spec.max = request.maximum
    if spec.max < spec.min:
        which = "--max" if request.maximum is not None else "--min"
        raise ValueError(f"{which}: max {spec.max} is below min {spec.min}")
    if request.replicas is not None and not spec.min <= request.replicas <= spec.max:
        raise ValueError(f"REPLICAS {request.replicas}: outside --min {spec.min} / --max {spec.max}")
    if cold_s2z:
        return new
    current = request.replicas if request.replicas is not None else desired_replicas(env)
    new.effective_replicas = min(max(current, spec.min), spec.max)
    return new
