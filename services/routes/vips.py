"""VIP allocation: every environment with a declared port holds an internal virtual IP (docs/networking.md).

The leader of ``lease.vips`` keeps ``vip.<env_id>`` (ServiceVIP) in line with the environments: an env
that needs a VIP and has none gets the lowest free address of 127.128.0.0/16 scanning ``127.128.a.b`` with
``a`` = 0..255 and ``b`` = 2..254 (``.0``, ``.1`` and ``.255`` are never used: 256 × 253 = 64,768
addresses); an env keeps its VIP across passes; a VIP whose env no longer needs one (no ports, or env
gone) is freed. Pool exhausted: a warning, the env is skipped. Envs are served in id order, so the
result is a function of the state.

The range is loopback (127/8): a connection to a VIP never leaves the machine, and it cannot collide with
a real network. Apps reach an env at their own address ``127.(128+c).a.b`` (the VIP's host part ``a.b``),
so two VIPs are distinct by their host part: a VIP held from the earlier range (``10.97.a.b``, until
migration 0003 rewrites it) keeps its ``a.b`` taken.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.decision import Decision
from shared.loop import LeaderLoop

log = logging.getLogger(__name__)

VIP_PREFIX = "127.128"
VIP_RANGE = f"{VIP_PREFIX}.0.0/16"
FIRST_HOST = 2
LAST_HOST = 254


def vip_pool() -> Iterator[str]:
    """Every allocatable VIP, lowest first."""
    for a in range(256):
        for b in range(FIRST_HOST, LAST_HOST + 1):
            yield f"{VIP_PREFIX}.{a}.{b}"


def host_part(vip: str) -> str:
    """``a.b`` of ``x.y.a.b``: what tells VIPs apart (an app's address of an env is ``127.(128+c).a.b``)."""
    return vip.split(".", 2)[-1]


@dataclass
class VipPlan:
    allocate: dict[str, str] = field(default_factory=dict)  # env id -> new VIP
    free: list[str] = field(default_factory=list)  # env ids whose VIP goes
    exhausted: list[str] = field(default_factory=list)  # env ids left without one

    def __bool__(self) -> bool:
        return bool(self.allocate or self.free)


def plan_vips(envs: Iterable[pb.Environment], vips: Iterable[pb.ServiceVIP]) -> VipPlan:
    """The allocation pass as a pure function of the envs and the current VIPs."""
    needed = sorted(env.meta.id for env in envs if env.service.ports)
    held = {vip.environment_id: vip.vip for vip in vips}
    needed_set = set(needed)
    plan = VipPlan(free=sorted(env_id for env_id in held if env_id not in needed_set))
    used = {host_part(vip) for env_id, vip in held.items() if env_id in needed_set and vip}
    pool = vip_pool()
    for env_id in needed:
        if held.get(env_id):
            continue
        address = next((candidate for candidate in pool if host_part(candidate) not in used), None)
        if address is None:
            plan.exhausted.append(env_id)
            continue
        used.add(host_part(address))
        plan.allocate[env_id] = address
    return plan


class VipAllocator(LeaderLoop):
    """The ``vips`` leader loop: applies :func:`plan_vips` to the state on every env or VIP change."""

    name = "vips"
    kinds = frozenset({K.ENV, K.VIP})

    async def run_pass(self) -> None:
        plan = plan_vips(self.view.envs(), self.view.vips())
        if plan.exhausted:
            log.warning("vips: pool %s exhausted; %d envs left without a VIP", VIP_RANGE, len(plan.exhausted))
        if not plan:
            return
        writes = [Decision("vip.free", deletes=[K.vip(env_id)]) for env_id in plan.free]
        writes += [
            Decision("vip.allocate", puts=[pb.ServiceVIP(environment_id=env_id, vip=address)])
            for env_id, address in plan.allocate.items()
        ]
        failed = len(writes) - sum(await self.commit_decisions(writes))
        if failed:
            log.info("vips: %d of %d writes refused (state moved); the next pass re-decides", failed, len(writes))
