"""Why a release is short of nodes: :func:`explain` counts, per placement filter (:data:`FILTERS
<shared.placement.placement.FILTERS>`), the nodes it removed. Computed when asked (the scheduler's
``schedule.no_capacity`` event, ``zattera status``), never on the placement path."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.placement.placement import FILTERS, capacity_of, status_filter, volume_pin
from shared.placement.platforms import platform_set
from shared.state.reader import StateReader
from shared.state.tables import reservation


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why placement finds no room: the nodes each of :data:`FILTERS` removed, and how many passed them."""

    nodes: int
    filtered: dict[str, int]
    """Filter name → nodes it removed (a node counts under the first filter it fails); only non-zero ones."""
    fit: int
    """Nodes that pass every filter with room for one more replica."""

    def summary(self) -> str:
        """E.g. ``5 nodes: 3 filtered by arch, 2 by memory``."""
        if self.nodes == 0:
            return "no nodes registered"
        parts = [f"{count} by {name}" for name, count in self.filtered.items()]
        if parts:
            parts[0] = parts[0].replace(" by ", " filtered by ", 1)
        if self.fit:
            parts.append(f"{self.fit} with room")
        return f"{self.nodes} node{'s' * (self.nodes != 1)}: " + ", ".join(parts)


def explain(view: StateReader, release: pb.Release, env_id: str, exclude: Collection[str] = frozenset()) -> Explanation:
    """Count, per named filter, the nodes of the view it removes for one more replica of ``release``.

    The same rules as :func:`place` over the view as it is (without the reservations of a pass in
    progress); one pass over the nodes, for a caller that wants to say why a placement fell short.
    """
    pin, pin_error = volume_pin(view, release, env_id)
    wants = _Wants(
        platform_set(release.platforms),
        tuple(sorted(release.service.placement_constraints.items())),
        pin,
        pin_error is not None,
        *reservation(release),
    )
    counts = dict.fromkeys(FILTERS, 0)
    nodes = view.nodes()
    fit = 0
    for node in nodes:
        reason = "excluded" if node.meta.id in exclude else wants.first_filter(node, view)
        if reason is None:
            fit += 1
        else:
            counts[reason] += 1
    return Explanation(len(nodes), {name: n for name, n in counts.items() if n}, fit)


@dataclass(frozen=True, slots=True)
class _Wants:
    """What one more replica of a release asks of a node."""

    platforms: frozenset[str]
    constraints: tuple[tuple[str, str], ...]
    pin: str
    split_pins: bool
    cpu: int
    mem: int

    def first_filter(self, node: pb.Node, view: StateReader) -> str | None:
        """The name of the first filter ``node`` fails (None: it takes the replica)."""
        status = status_filter(node)
        if status is not None:
            return status
        info = capacity_of(node)
        if not info.platform_ok(self.platforms):
            return "arch"
        if not info.labels_ok(self.constraints):
            return "labels"
        if self.split_pins or (self.pin and self.pin != info.id):
            return "volume pin"
        cpu, mem = view.reserved(info.id)
        if not info.cpu_fits(cpu, self.cpu):
            return "cpu"
        if not info.mem_fits(mem, self.mem):
            return "memory"
        return None
