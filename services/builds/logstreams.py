"""Log streams (lease ``logstreams``): one instance-log stream per environment, sized to its retention.

``zattera.logs.<env>.<instance>`` goes to ``ZATTERA_LOGS_<env>`` (shared/applogs.py says why a stream per
environment). This loop creates the stream of every environment, updates its limits when the env's
``[env.<name>.logs]`` (``Environment.logs``) or the cluster defaults (``ZATTERA_LOGS_MAX_BYTES``,
``ZATTERA_LOGS_MAX_AGE``) change, and deletes the stream of an environment that no longer exists. Until
an environment's stream exists its agents keep the lines in the instances' files (nothing is lost).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nats.js.errors import APIError, NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.applogs import LogLimits, app_logs_stream, app_logs_stream_config, env_of_stream, retention_of
from shared.loop import LeaderLoop, LoopDeps
from shared.provisioning import create_or_update_stream, recorded_replicas

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LogStreamPlan:
    upserts: dict[str, LogLimits]
    """Env id → the limits its stream must get (created when missing)."""
    deletes: list[str]
    """Env ids whose stream must go (the environment is gone)."""


def plan_log_streams(
    envs: Iterable[pb.Environment], existing: Mapping[str, LogLimits], default: LogLimits
) -> LogStreamPlan:
    wanted = {env.meta.id: retention_of(env, default) for env in envs}
    upserts = {env_id: r for env_id, r in wanted.items() if existing.get(env_id) != r}
    deletes = sorted(env_id for env_id in existing if env_id not in wanted)
    return LogStreamPlan(upserts=upserts, deletes=deletes)


class LogStreams(LeaderLoop):
    name = "logstreams"
    kinds = frozenset({K.ENV})

    def __init__(self, deps: LoopDeps, *, default: LogLimits, replicas: int, tick: float = 60.0) -> None:
        super().__init__(deps, tick=tick)
        self.default = default
        self.replicas = replicas

    async def existing(self) -> dict[str, LogLimits]:
        found: dict[str, LogLimits] = {}
        for info in await self.conn.js.streams_info():
            env_id = env_of_stream(info.config.name or "")
            if env_id:
                found[env_id] = LogLimits(int(info.config.max_bytes or -1), float(info.config.max_age or 0.0))
        return found

    async def run_pass(self) -> None:
        if not self.replicas:  # ZATTERA_REPLICAS=0 (the default): what the cluster's init recorded
            self.replicas = await recorded_replicas(self.conn.js)
        plan = plan_log_streams(self.view.envs(), await self.existing(), self.default)
        for env_id, retention in plan.upserts.items():
            log.info("log stream of %s: max %d bytes, %.0f s", env_id, retention.max_bytes, retention.max_age)
            try:
                await create_or_update_stream(self.conn.js, app_logs_stream_config(env_id, retention, self.replicas))
            except APIError as exc:  # refused for this env (its limits): the others' streams still follow
                log.warning("log stream of %s not created: %s", env_id, exc.description or exc)
        for env_id in plan.deletes:
            log.info("log stream of %s: environment gone; deleting", env_id)
            try:
                await self.conn.js.delete_stream(app_logs_stream(env_id))
            except NotFoundError:
                pass
