"""The tables and indexes a :class:`shared.state.store.StateStore` keeps (one table per kind; by env, by node,
per-node reservations and RUN replica counts), and the pure rules it applies: an assignment's reservation,
the merge of an observed report into the last one."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared import keys as K

RUN = pb.ASSIGNMENT_DESIRED_RUN


DEFAULT_CPU_MILLIS = 100


DEFAULT_MEMORY_MB = 256


_HEALTH_STATES = (pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY)


M = TypeVar("M", bound=Message)


def reservation(release: pb.Release | None) -> tuple[int, int]:
    """Per-replica reservation (cpu_millis, memory_mb): declared resources, defaults per zero dimension."""
    if release is None:
        return DEFAULT_CPU_MILLIS, DEFAULT_MEMORY_MB
    res = release.service.resources
    return res.cpu_millis or DEFAULT_CPU_MILLIS, res.memory_mb or DEFAULT_MEMORY_MB


def merge_observed(prev: pb.AssignmentObserved | None, new: pb.AssignmentObserved) -> pb.AssignmentObserved:
    """A RUNNING report never downgrades HEALTHY/UNHEALTHY of the same container (health is news RUNNING lacks).

    A different container id means a new instance, whose RUNNING is real news and replaces the old state.
    """
    if (
        prev is not None
        and new.state == pb.INSTANCE_STATE_RUNNING
        and prev.state in _HEALTH_STATES
        and new.container_id == prev.container_id
    ):
        merged = pb.AssignmentObserved()
        merged.CopyFrom(new)
        merged.state = prev.state
        return merged
    return new


@dataclass(slots=True)
class Entry(Generic[M]):
    msg: M
    rev: int


def entry_msg(entry: Entry[M] | None) -> M | None:
    return entry.msg if entry is not None else None


class Tables:
    """One table (id -> entry) per kind. The typed attributes are the very dicts ``by_kind`` holds, so the
    typed reads need no casts and the generic path (apply, ``get``, ``all``) reaches every kind."""

    def __init__(self) -> None:
        self.node: dict[str, Entry[pb.Node]] = {}
        self.project: dict[str, Entry[pb.Project]] = {}
        self.app: dict[str, Entry[pb.App]] = {}
        self.env: dict[str, Entry[pb.Environment]] = {}
        self.release: dict[str, Entry[pb.Release]] = {}
        self.deployment: dict[str, Entry[pb.Deployment]] = {}
        self.build: dict[str, Entry[pb.Build]] = {}
        self.assignment: dict[str, Entry[pb.Assignment]] = {}
        self.volume: dict[str, Entry[pb.Volume]] = {}
        self.snapshot: dict[str, Entry[pb.VolumeSnapshot]] = {}
        self.vip: dict[str, Entry[pb.ServiceVIP]] = {}
        self.lease: dict[str, Entry[pb.Lease]] = {}
        typed: dict[str, dict[str, Entry[Any]]] = {
            K.NODE: self.node,
            K.PROJECT: self.project,
            K.APP: self.app,
            K.ENV: self.env,
            K.RELEASE: self.release,
            K.DEPLOYMENT: self.deployment,
            K.BUILD: self.build,
            K.ASSIGNMENT: self.assignment,
            K.VOLUME: self.volume,
            K.SNAPSHOT: self.snapshot,
            K.VIP: self.vip,
            K.LEASE: self.lease,
        }
        self.by_kind: dict[str, dict[str, Entry[Any]]] = {kind: typed.get(kind, {}) for kind in K.ALL_KINDS}


@dataclass
class Indexes:
    by_env: dict[str, dict[str, dict[str, Message]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(dict))
    )
    assignments_by_node: dict[str, dict[str, pb.Assignment]] = field(default_factory=lambda: defaultdict(dict))
    assignments_by_release: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    reserved: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    contribution: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    env_node_run: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    run_counted: dict[str, tuple[str, str]] = field(default_factory=dict)


ENV_INDEXED = {
    K.RELEASE: "environment_id",
    K.DEPLOYMENT: "environment_id",
    K.ASSIGNMENT: "environment_id",
    K.VOLUME: "environment_id",
    K.BUILD: "environment_id",
    K.DOMAIN: "environment_id",
    K.SECRET: "environment_id",
    K.JOB: "environment_id",
}
