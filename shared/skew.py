"""Version skew: which Zattera versions may run together on one cluster, as pure decisions (docs/upgrades.md).

The cluster's version is the one recorded with its schema (the control plane that initialised it or last
upgraded it; 0.1.0 when none is recorded). Versions are counted in release lines (major.minor):

* the control plane upgrades a cluster whose schema is older than its own (migrations), runs on one at its
  own schema, and refuses one at a newer schema (a downgrade);
* agents, proxies and the CLI may be one release line behind the cluster, never more;
* an agent or CLI that needs a newer schema than the cluster's waits for (agent) or asks for (CLI writes)
  the control plane's upgrade first; a proxy, which writes nothing but its heartbeat, says so and serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shared.errors import ZatteraError
from shared.version import LEGACY_VERSION, BadVersion, release_line

DOCS = "docs/upgrades.md"


class Component(StrEnum):
    CONTROL_PLANE = "control plane"
    AGENT = "agent"
    PROXY = "proxy"
    CLI = "zattera CLI"


class Verdict(StrEnum):
    OK = "ok"
    BEHIND = "behind"
    """One release line behind the cluster: allowed (a rolling upgrade under way); upgrade it next."""
    UPGRADE = "upgrade"
    """The control plane brings the cluster to its schema (the migrations), then runs."""
    WAIT = "wait"
    """Needs a newer schema than the cluster's: the control plane must be upgraded first."""
    TOO_OLD = "too old"
    DOWNGRADE = "downgrade"
    """A control plane older than the cluster's schema: refused."""


REFUSED = frozenset({Verdict.TOO_OLD, Verdict.DOWNGRADE})


class SkewRefused(ZatteraError):
    """This process may not run against this cluster (too old, or a control plane's downgrade)."""


@dataclass(frozen=True)
class Skew:
    verdict: Verdict
    message: str = ""
    """One line saying what is wrong and what to do ("" when OK)."""

    @property
    def refused(self) -> bool:
        return self.verdict in REFUSED


def cluster_version(recorded: str) -> str:
    return recorded or LEGACY_VERSION


def _line(version: str) -> tuple[int, int] | None:
    try:
        return release_line(version)
    except BadVersion:
        return None


def lines_behind(version: str, cluster: str) -> int | None:
    """How many release lines ``version`` is behind ``cluster`` (negative: ahead); None when either is no
    version or the majors differ (a major release is never mixed with another)."""
    own, theirs = _line(version), _line(cluster_version(cluster))
    if own is None or theirs is None or own[0] != theirs[0]:
        return None
    return theirs[1] - own[1]


def _about(verdict: Verdict, component: Component, version: str, what: str) -> Skew:
    """A verdict on this process, the message naming it (``what`` it is or needs) and the docs."""
    return Skew(verdict, f"this {component} (Zattera {version}) {what} ({DOCS})")


def judge(component: Component, version: str, schema: int, recorded_version: str, recorded_schema: int) -> Skew:
    """May ``component`` of Zattera ``version`` (schema ``schema``) run against a cluster recorded at
    ``recorded_version`` / ``recorded_schema``?"""
    cluster = cluster_version(recorded_version)
    where = f"the cluster (Zattera {cluster}, schema {recorded_schema})"
    behind = lines_behind(version, cluster)
    if component is Component.CONTROL_PLANE and schema < recorded_schema:
        return Skew(
            Verdict.DOWNGRADE,
            f"{where} is newer than this control plane (Zattera {version}, schema {schema}): downgrades are "
            f"refused; run Zattera {cluster} or newer ({DOCS})",
        )
    if behind is None or behind > 1:
        line = _line(cluster)
        oldest = f"{line[0]}.{max(0, line[1] - 1)}" if line else cluster
        return _about(
            Verdict.TOO_OLD, component, version, f"is too old for {where}, which accepts {oldest} or newer: upgrade it"
        )
    if schema > recorded_schema:
        if component is Component.CONTROL_PLANE:
            return Skew(Verdict.UPGRADE, f"upgrading {where} to schema {schema} (Zattera {version})")
        return _about(
            Verdict.WAIT,
            component,
            version,
            f"needs schema {schema}; {where} has not been upgraded yet: upgrade the control plane first",
        )
    if behind == 1:
        return _about(
            Verdict.BEHIND,
            component,
            version,
            f"is one release behind {where}: allowed while upgrading; upgrade it next",
        )
    return Skew(Verdict.OK)


def judge_peer(component: Component, version: str, control_version: str) -> Skew:
    """What a process that writes nothing of the state (a proxy) says about the control plane it hears
    from (a route snapshot's ``control_version``): it serves either way."""
    if not control_version:
        return Skew(Verdict.OK)  # a control plane from before versions were sent: the previous line
    behind = lines_behind(version, control_version)
    where = f"its control plane (Zattera {control_version})"
    if behind is None or behind > 1:
        return _about(Verdict.TOO_OLD, component, version, f"is too old for {where}: upgrade it")
    if behind < 0:
        return _about(Verdict.WAIT, component, version, f"is newer than {where}: upgrade the control plane first")
    if behind == 1:
        return _about(Verdict.BEHIND, component, version, f"is one release behind {where}: upgrade it next")
    return Skew(Verdict.OK)


def node_version_note(version: str, recorded_version: str) -> str:
    """What ``zattera nodes list`` says beside a node's version: ``""``, ``behind`` or ``too old`` (also for a
    version that is none, or of another major), ``newer`` (its control plane is not upgraded yet)."""
    if not version:
        return "unknown"
    behind = lines_behind(version, recorded_version)
    if behind is None or behind > 1:
        return "too old"
    if behind == 1:
        return "behind"
    if behind < 0:
        return "newer"
    return ""
