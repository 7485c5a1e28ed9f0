"""``zattera cluster replicas N``: every stream to N copies, one stream at a time, the state stream last.

The join service does the change (:mod:`shared.replicas`, it holds the control credential); this asks it
for the plan, then stream by stream, reporting each one as it is caught up. Streams already at N are
skipped; a change cut short (a timeout, a refusal) is finished by running the action again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

from shared.actions.refusals import ask_service, refusal_from_dict
from shared.replicas import CLUSTER_REPLICAS_SUBJECT, DEFAULT_TIMEOUT, PLAN_WAIT, StreamChanged, check_count


@dataclass(frozen=True)
class ChangeReplicas:
    replicas: int
    timeout: float = DEFAULT_TIMEOUT
    """How long one stream's copies may take to catch up."""


@dataclass
class ReplicasChanged:
    replicas: int
    recorded_before: int
    streams: list[StreamChanged] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return sum(1 for s in self.streams if s.changed)


async def _ask(nc: NATS, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    data = await ask_service(
        nc,
        CLUSTER_REPLICAS_SUBJECT,
        json.dumps(request).encode(),
        timeout,
        unavailable="no join service answered on zattera.cluster.replicas (is the control plane up?)",
    )
    reply: dict[str, Any] = json.loads(data or b"{}")
    if "refused" in reply:
        raise refusal_from_dict(reply["refused"])
    return reply


async def change_replicas(
    nc: NATS, request: ChangeReplicas, progress: Callable[[StreamChanged], None] = lambda _: None
) -> ReplicasChanged:
    replicas = check_count(request.replicas)
    plan = await _ask(nc, {"replicas": replicas}, timeout=PLAN_WAIT)
    result = ReplicasChanged(replicas, int(plan.get("recorded") or 1))
    for stream in plan.get("streams") or []:
        answer = await _ask(
            nc,
            {"replicas": replicas, "stream": stream["stream"], "timeout": request.timeout},
            timeout=request.timeout + 10.0,
        )
        done = StreamChanged(**{**answer, "servers": tuple(answer.get("servers") or ())})
        result.streams.append(done)
        progress(done)
    return result
