"""The build dispatcher's decisions, pure: values in, values out, table-tested with a fake clock
(tests/builds/test_decisions.py). The loop (dispatcher.py) and the event followers (followers.py) feed them
from the view and the build-event stream and carry them out.

Builder = ALIVE, schedulable, label ``builder=true``;
fewest RUNNING builds first, tie by node id (sticky when idle); outcome texts ``build failed``,
``build ended without producing an image``, ``builder lost``; refs ``<repo>:<lower build id>`` and
``<repo>@<digest>``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.builds.settings import BuildsSettings
from shared.buildlogs import TERMINAL_STATUSES
from shared.clock import from_timestamp, to_timestamp
from shared.registry import repository
from shared.subjects import build_log_subject

CLAIM_IN_FLIGHT = 12.0
"""A RUNNING build resumed by a new term (or a new leader) within this many seconds of its claim is sent its
RunBuild again: its claimer may have been deposed between the claim landing (its reply lost with a NATS
server) and sending the request. Longer than a claim's commit timeout (10 s); the builder accepts a build id
it already has without running it twice. Older resumed builds are only followed (a silent one is lost)."""
WAITING_KIND = "build.waiting_for_builder"
WAITING_MESSAGE = "no schedulable builder node (cordoned, down, or builder=false); the build stays queued"
BUILDER_LABEL = "builder"
OS_ARCH_LABEL = "zattera.dev/os-arch"
BUILD_PLATFORMS_LABEL = "zattera.dev/build-platforms"

BUILDER_LOST = "builder lost"
BUILD_FAILED = "build failed"
NO_IMAGE = "build ended without producing an image"

RUNNING = pb.BUILD_STATUS_RUNNING
QUEUED = pb.BUILD_STATUS_QUEUED


@dataclass(frozen=True, slots=True)
class BuildDispatcherConfig:
    """What the dispatcher stamps into requests, and its timers (seconds)."""

    source_url_base: str = ""
    """Prefix of the tarball digest in ``source_url``; "" = the object name in ``zattera-sources``."""
    registry_addr: str = ""
    """Registry host prefixed to image refs; "" = the object-store registry (refs ``<project>/<app>``)."""
    local_load: bool = False
    """Dev mode: builders load the image locally; the build's ref is then the push (tag) ref."""
    builder_lost_timeout: float = 240.0
    builder_concurrency: int = 2
    checkpoint_interval: float = 15.0
    request_timeout: float = 5.0

    @classmethod
    def of(cls, settings: BuildsSettings) -> BuildDispatcherConfig:
        """The dispatcher's part of the builds settings: each of its fields that is a setting of the same name."""
        return cls(**settings.model_dump(include={f.name for f in fields(cls)}))


# ---------------------------------------------------------------------------------------- dispatching


def is_builder(node: pb.Node) -> bool:
    return node.status == pb.NODE_STATUS_ALIVE and node.schedulable and node.labels.get(BUILDER_LABEL) == "true"


def builder_platforms(node: pb.Node) -> frozenset[str]:
    """The platforms a builder can produce: its own, plus the emulated ones its label declares."""
    native = {p for p in (node.os_arch, node.labels.get(OS_ARCH_LABEL, "")) if p}
    extra = {p.strip() for p in node.labels.get(BUILD_PLATFORMS_LABEL, "").split(",") if p.strip()}
    return frozenset(native | extra)


def can_build(node: pb.Node, platforms: Sequence[str]) -> bool:
    """Empty platforms = the builder's native one (any builder can)."""
    return not platforms or set(platforms) <= builder_platforms(node)


def pick_builder(candidates: Iterable[pb.Node], load: Mapping[str, int], cap: int) -> str | None:
    """Fewest running builds, tie by node id, among candidates below the cap."""
    free = [(load.get(n.meta.id, 0), n.meta.id) for n in candidates if load.get(n.meta.id, 0) < cap]
    return min(free)[1] if free else None


@dataclass(frozen=True, slots=True)
class Dispatch:
    build_id: str
    node_id: str


@dataclass(frozen=True, slots=True)
class Waiting:
    build_id: str
    message: str


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    dispatch: tuple[Dispatch, ...] = ()
    waiting: tuple[Waiting, ...] = ()
    """QUEUED builds no builder node can take at all (not merely busy ones)."""
    lost: tuple[str, ...] = ()
    next_deadline: float | None = None


def last_event_time(build: pb.Build, seen: Mapping[str, float]) -> float:
    return max(from_timestamp(build.last_event_at), from_timestamp(build.started_at), seen.get(build.meta.id, 0.0))


def evaluate(
    builds: Sequence[pb.Build],
    nodes: Sequence[pb.Node],
    *,
    now: float,
    last_event_seen: Mapping[str, float],
    cap: int,
    lost_timeout: float,
) -> DispatchPlan:
    """One pass: which RUNNING builds are lost, which QUEUED builds go where (in id order), which wait."""
    load: dict[str, int] = {}
    lost: list[str] = []
    next_deadline: float | None = None
    queued: list[pb.Build] = []
    for build in builds:
        if build.status == RUNNING:
            load[build.node_id] = load.get(build.node_id, 0) + 1
            deadline = last_event_time(build, last_event_seen) + lost_timeout
            if now >= deadline:
                lost.append(build.meta.id)
            elif next_deadline is None or deadline < next_deadline:
                next_deadline = deadline
        elif build.status == QUEUED:
            queued.append(build)
    builders = [n for n in nodes if is_builder(n)]
    candidates_by_platforms: dict[tuple[str, ...], list[pb.Node]] = {}
    dispatch: list[Dispatch] = []
    waiting: list[Waiting] = []
    for build in queued:
        platforms = tuple(sorted(build.platforms))
        candidates = candidates_by_platforms.get(platforms)
        if candidates is None:
            candidates = [n for n in builders if can_build(n, platforms)]
            candidates_by_platforms[platforms] = candidates
        if not candidates:
            message = (
                WAITING_MESSAGE
                if not builders
                else f"no builder node can build {', '.join(platforms)}; the build stays queued"
            )
            waiting.append(Waiting(build.meta.id, message))
            continue
        node_id = pick_builder(candidates, load, cap)
        if node_id is None:
            continue
        load[node_id] = load.get(node_id, 0) + 1
        dispatch.append(Dispatch(build.meta.id, node_id))
    return DispatchPlan(tuple(dispatch), tuple(waiting), tuple(lost), next_deadline)


@dataclass(frozen=True, slots=True)
class Verdict:
    status: int
    error: str = ""
    digest: str = ""
    platforms: tuple[str, ...] = ()


@dataclass(slots=True)
class StreamProgress:
    """What a build's events told so far (the last non-empty digest and platforms win)."""

    digest: str = ""
    platforms: tuple[str, ...] = ()


def apply_event(progress: StreamProgress, event: cpb.BuildEvent) -> Verdict | None:
    """Per event, in this order: digest, platforms, error, FAILED status; success only at the end."""
    if event.image_digest:
        progress.digest = event.image_digest
    if event.platforms:
        progress.platforms = tuple(event.platforms)
    if event.error:
        return Verdict(pb.BUILD_STATUS_FAILED, event.error)
    if event.status == pb.BUILD_STATUS_FAILED:
        return Verdict(pb.BUILD_STATUS_FAILED, BUILD_FAILED)
    if event.done:
        if not progress.digest:
            return Verdict(pb.BUILD_STATUS_FAILED, NO_IMAGE)
        return Verdict(pb.BUILD_STATUS_SUCCEEDED, digest=progress.digest, platforms=progress.platforms)
    return None


def push_ref(build: pb.Build, config: BuildDispatcherConfig) -> str:
    return f"{repository(build.project_id, build.app_id, config.registry_addr)}:{build.meta.id.lower()}"


def deploy_ref(build: pb.Build, digest: str, config: BuildDispatcherConfig) -> str:
    if config.local_load:
        return push_ref(build, config)
    return f"{repository(build.project_id, build.app_id, config.registry_addr)}@{digest}"


def copy_build(build: pb.Build) -> pb.Build:
    b = pb.Build()
    b.CopyFrom(build)
    return b


def claimed_build(build: pb.Build, node_id: str, now: float) -> pb.Build:
    b = copy_build(build)
    b.status = RUNNING
    b.node_id = node_id
    b.started_at.CopyFrom(to_timestamp(now))
    b.last_event_at.CopyFrom(to_timestamp(now))
    b.log_subject = build_log_subject(build.meta.id)
    b.error = ""
    return b


def finished_build(build: pb.Build, verdict: Verdict, config: BuildDispatcherConfig, now: float) -> pb.Build:
    b = copy_build(build)
    b.status = verdict.status  # type: ignore[assignment]
    b.finished_at.CopyFrom(to_timestamp(now))
    if verdict.status == pb.BUILD_STATUS_SUCCEEDED:
        b.image_ref = deploy_ref(build, verdict.digest, config)
        b.image_digest = verdict.digest
        b.error = ""
        if verdict.platforms:
            del b.platforms[:]
            b.platforms.extend(verdict.platforms)
    else:
        b.error = verdict.error
    return b


def run_request(build: pb.Build, config: BuildDispatcherConfig, app: pb.App | None = None) -> cpb.RunBuildRequest:
    request = cpb.RunBuildRequest(build=build, push_image_ref=push_ref(build, config))
    if app is not None:
        request.build_config.CopyFrom(app.build)
        request.build_args.update(app.build.build_args)
    if build.tarball_digest:
        request.source_url = config.source_url_base + build.tarball_digest
    if build.git_clone_url:
        request.git.clone_url = build.git_clone_url
        request.git.ref = build.git_sha or build.git_branch
    return request


# ---------------------------------------------------------------------------------------- following builds


@dataclass(frozen=True, slots=True)
class Followed:
    """What the plan needs of a build this leader follows."""

    node_id: str
    concluding: bool


@dataclass(frozen=True, slots=True)
class FollowPlan:
    let_go: tuple[str, ...] = ()
    """Followed builds no longer RUNNING on the node followed (canceled by an operator, or moved)."""
    wrap_up: tuple[tuple[str, int], ...] = ()
    """Those of ``let_go`` that ended, with their status: their builder is told to stop, their log ended."""
    follow: tuple[str, ...] = ()
    """RUNNING builds nobody follows (resumed by this term)."""


def plan_following(
    builds: Iterable[pb.Build], build_of: Callable[[str], pb.Build | None], followed: Mapping[str, Followed]
) -> FollowPlan:
    """Follow every RUNNING build; let go of builds that ended elsewhere (a concluding one finishes itself)."""
    let_go: list[str] = []
    wrap_up: list[tuple[str, int]] = []
    for build_id, f in followed.items():
        build = build_of(build_id)
        if f.concluding or (build and build.status == RUNNING and build.node_id == f.node_id):
            continue
        let_go.append(build_id)
        if build is not None and build.status in TERMINAL_STATUSES:
            wrap_up.append((build_id, build.status))
    kept = followed.keys() - set(let_go)
    follow = [b.meta.id for b in builds if b.status == RUNNING and b.node_id and b.meta.id not in kept]
    return FollowPlan(tuple(let_go), tuple(wrap_up), tuple(follow))


class EventRoute(enum.Enum):
    """What to do with an event of a build nobody follows."""

    FOLLOW = "follow"
    """A RUNNING build (resumed by this event)."""
    STOP_BUILDER = "stop builder"
    """A builder still streams, live, for a build that already ended (canceled, or failed as lost)."""
    IGNORE = "ignore"


def route_unfollowed_event(build: pb.Build | None, event: cpb.BuildEvent, *, live: bool) -> EventRoute:
    if build is not None and build.status == RUNNING and build.node_id:
        return EventRoute.FOLLOW
    if live and build is not None and build.status in TERMINAL_STATUSES and not event.done:
        return EventRoute.STOP_BUILDER
    return EventRoute.IGNORE


def event_time(*, live: bool, stored_at: float, now: float) -> float:
    """When an event counts for the builder-lost timeout: a live one when it arrives; a replayed one
    (stored before this term began) when the stream stored it, never later than now."""
    return now if live else min(stored_at, now)


def checkpoint_due(last_event_at: float, checkpointed_at: float, interval: float) -> bool:
    """``Build.last_event_at`` is written every ``interval`` of events, not on each one."""
    return last_event_at - checkpointed_at >= interval


def resend_on_resume(build: pb.Build, now: float) -> bool:
    """A resumed build claimed moments ago may never have been sent its RunBuild (``CLAIM_IN_FLIGHT``)."""
    return now - from_timestamp(build.started_at) < CLAIM_IN_FLIGHT
