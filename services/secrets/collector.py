"""Secret versions nothing uses any more are deleted (lease ``secrets-gc``).

A sealed version is kept while its environment's staged configuration or any of its releases references it
(a rollback can only go to a release that still exists; release retention deletes old ones). The CLI
already deletes what its own change orphans, in the same write; this loop catches what other writers
orphan: releases pruned by retention, environments deleted. Only versions older than a grace period are
collected, so a pass never races the write that creates a version and its reference together.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from zattera.v1 import types_pb2 as pb

from services.secrets.settings import DEFAULTS as OWN
from shared import keys as K
from shared.decision import Decision
from shared.loop import LeaderLoop, LoopDeps
from shared.settings import DEFAULTS

log = logging.getLogger(__name__)


def collectable(
    secrets: Iterable[pb.SealedSecret],
    envs: Mapping[str, pb.Environment],
    releases_of: Mapping[str, Sequence[pb.Release]],
    now: float,
    grace: float,
) -> list[str]:
    """Ids of sealed versions older than ``grace`` that no env's staged spec nor any release references."""
    used: set[str] = set()
    for env in envs.values():
        used.update(ref.secret_id for ref in env.service.secrets.values())
    for releases in releases_of.values():
        for release in releases:
            used.update(ref.secret_id for ref in release.service.secrets.values())
    return [
        s.meta.id for s in secrets if s.meta.id not in used and s.meta.created_at.ToNanoseconds() / 1e9 <= now - grace
    ]


class SecretsCollector(LeaderLoop):
    name = "secrets-gc"
    kinds = frozenset({K.SECRET, K.RELEASE, K.ENV})

    def __init__(self, deps: LoopDeps, *, grace: float = OWN.gc_grace, tick: float = DEFAULTS.loop_tick) -> None:
        super().__init__(deps, tick=tick)
        self.grace = grace

    async def run_pass(self) -> None:
        view = self.view
        sealed = view.all(K.SECRET)
        if not sealed:
            return
        envs = {s.environment_id: e for s in sealed if (e := view.env(s.environment_id)) is not None}
        releases_of = {env_id: view.releases(env_id) for env_id in {s.environment_id for s in sealed}}
        doomed = collectable(sealed, envs, releases_of, self.clock.now(), self.grace)
        if not doomed:
            return
        landed = await self.commit_decisions([Decision("secrets-gc", deletes=[K.secret(i)]) for i in doomed])
        deleted = sum(landed)
        log.info("secrets-gc: deleted %d unused secret version(s)", deleted)
