"""Scaling an environment by hand (``zattera scale``, the console's scale form).

REPLICAS alone is a fixed count (min = max = N: the autoscaler has no room); ``minimum``/``maximum`` set
the bounds the autoscaler moves within (with REPLICAS: the count to start from, inside them), and the
current count is brought inside them. A cold scale-to-zero env stays cold (its next request wakes it within
the new bounds); REPLICAS 0 on one cools it now without touching its bounds. The next ``zattera apps
apply`` sets the bounds from zattera.toml again.
"""

from __future__ import annotations

from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext, commit
from shared.actions.fields import EnvPath, EnvRef
from shared.actions.names import env_path, target_env
from shared.actions.refusals import Invalid
from shared.clock import stamp
from shared.deployments import desired_replicas
from shared.retry import Attempt
from shared.state.reader import StateReader

EVENT_ENV_SCALED = "env.scaled"


@dataclass(frozen=True, slots=True)
class Scale:
    env: EnvRef
    replicas: int | None = None
    minimum: int | None = None
    maximum: int | None = None

    def check(self) -> None:
        """Refuse what is wrong whatever the state, naming the option."""
        if self.replicas is None and self.minimum is None and self.maximum is None:
            raise Invalid("replicas", "give REPLICAS (a fixed count) or --min/--max (the autoscaling bounds)", said="")
        for name, option, value in (
            ("replicas", "REPLICAS", self.replicas),
            ("minimum", "--min", self.minimum),
            ("maximum", "--max", self.maximum),
        ):
            if value is not None and value < 0:
                raise Invalid(name, "must be 0 or more", said=f"{option} {value}")


@dataclass(frozen=True, slots=True)
class Scaled:
    env_id: str
    env: EnvPath
    replicas: int
    minimum: int
    maximum: int
    message: str


def scaled(env: pb.Environment, request: Scale) -> pb.Environment:
    """The env with its replica bounds and count set as asked (a copy); refuses bounds that do not hold."""
    new = pb.Environment()
    new.CopyFrom(env)
    spec = new.service.replicas
    cold_s2z = env.service.scale_to_zero and env.effective_replicas == 0
    if request.replicas == 0 and env.service.scale_to_zero and request.minimum is None and request.maximum is None:
        new.effective_replicas = 0
        return new
    if request.minimum is None and request.maximum is None:
        spec.min = spec.max = request.replicas or 0
    if request.minimum is not None:
        spec.min = request.minimum
    if request.maximum is not None:
        spec.max = request.maximum
    if spec.max < spec.min:
        name, option = ("maximum", "--max") if request.maximum is not None else ("minimum", "--min")
        raise Invalid(name, f"max {spec.max} is below min {spec.min}", said=option)
    if request.replicas is not None and not spec.min <= request.replicas <= spec.max:
        raise Invalid("replicas", f"outside --min {spec.min} / --max {spec.max}", said=f"REPLICAS {request.replicas}")
    if cold_s2z:
        return new
    current = request.replicas if request.replicas is not None else desired_replicas(env)
    new.effective_replicas = min(max(current, spec.min), spec.max)
    return new


def decide_scale(view: StateReader, request: Scale, now: float) -> pb.Environment:
    """The environment record to write (pure)."""
    new = scaled(target_env(view, request.env), request)
    stamp(new.meta.updated_at, now)
    return new


async def scale(ctx: ActionContext, request: Scale) -> Scaled:
    request.check()

    def attempt() -> Attempt[pb.Environment]:
        new = decide_scale(ctx.view, request, ctx.clock.now())
        return Attempt(ctx.writer.txn("scale").put(new), new)

    new = await commit(
        ctx,
        attempt,
        contended=f"env {request.env}",
        kept_changing=f"env {request.env} kept changing while scaling; try again",
    )
    path = env_path(ctx.view, new)
    bounds = new.service.replicas
    message = f"scaled {path} to {new.effective_replicas} replica(s) (min {bounds.min}, max {bounds.max})"
    await ctx.announce(EVENT_ENV_SCALED, message, env=new)
    return Scaled(new.meta.id, path, new.effective_replicas, bounds.min, bounds.max, message)
