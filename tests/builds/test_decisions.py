"""Pure decisions of the dispatcher, retention and sweeper: fast table tests."""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.builds import retention
from services.builds.planning import (
    BUILDER_LOST,
    CLAIM_IN_FLIGHT,
    BuildDispatcherConfig,
    DispatchPlan,
    EventRoute,
    Followed,
    FollowPlan,
    StreamProgress,
    Verdict,
    apply_event,
    can_build,
    checkpoint_due,
    evaluate,
    event_time,
    finished_build,
    is_builder,
    pick_builder,
    plan_following,
    resend_on_resume,
    route_unfollowed_event,
    run_request,
)
from services.builds.registry import collectable, referenced_blobs
from services.builds.settings import DEFAULTS as BUILDS_DEFAULTS
from services.builds.settings import BuildsSettings
from shared.registry import BlobInfo, InvalidDigest, image_id, parse_digest, parse_ref
from tests.builds import seed

QUEUED = pb.BUILD_STATUS_QUEUED
RUNNING = pb.BUILD_STATUS_RUNNING
FAILED = pb.BUILD_STATUS_FAILED
SUCCEEDED = pb.BUILD_STATUS_SUCCEEDED
T0 = 1_700_000_000.0

# ---------------------------------------------------------------------------------------- builder selection


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        ({}, "builder-a"),  # both idle: the lowest id (sticky when idle)
        ({"builder-a": 1}, "builder-b"),  # spills to the less loaded builder
        ({"builder-a": 1, "builder-b": 1}, "builder-a"),  # 1:1 ties back to the lowest id
        ({"builder-a": 2, "builder-b": 1}, "builder-b"),  # a at the cap
        ({"builder-a": 2, "builder-b": 2}, None),  # everyone at the cap: stays queued
    ],
)
def test_pick_builder_prefers_fewest_running_then_lowest_id_below_the_cap(
    load: dict[str, int], expected: str | None
) -> None:
    nodes = [seed.builder_node("builder-b"), seed.builder_node("builder-a")]
    assert pick_builder(nodes, load, 2) == expected


@pytest.mark.parametrize(
    ("node", "eligible"),
    [
        (seed.builder_node("n"), True),
        (seed.builder_node("n", cordoned=True), False),
        (seed.builder_node("n", status=pb.NODE_STATUS_SUSPECT), False),
        (seed.builder_node("n", status=pb.NODE_STATUS_DOWN), False),
        (seed.builder_node("n", status=pb.NODE_STATUS_DRAINING), False),
        (seed.builder_node("n", status=pb.NODE_STATUS_DRAINED), False),
        (seed.builder_node("n", labels={"builder": "false"}), False),
        (seed.builder_node("n", labels={"builder": "True"}), False),  # exact string "true"
    ],
)
def test_only_alive_schedulable_nodes_labelled_builder_true_build(node: pb.Node, eligible: bool) -> None:
    assert is_builder(node) is eligible


@pytest.mark.parametrize(
    ("platforms", "expected"),
    [
        ((), True),  # native build
        (("linux/arm64",), True),
        (("linux/amd64",), True),  # declared emulation
        (("linux/arm64", "linux/amd64"), True),
        (("linux/riscv64",), False),
    ],
)
def test_builder_builds_its_native_platform_and_declared_emulated_ones(
    platforms: tuple[str, ...], expected: bool
) -> None:
    node = seed.builder_node("n", os_arch="linux/arm64", labels={"zattera.dev/build-platforms": "linux/amd64"})
    assert can_build(node, platforms) is expected


# ---------------------------------------------------------------------------------------- one pass


def plan(
    builds: list[pb.Build], nodes: list[pb.Node], now: float = T0, seen: dict[str, float] | None = None
) -> DispatchPlan:
    return evaluate(builds, nodes, now=now, last_event_seen=seen or {}, cap=2, lost_timeout=240.0)


@pytest.mark.parametrize(
    ("now", "seen", "lost"),
    [
        (T0 + 239.999, {}, False),
        (T0 + 240.0, {}, True),  # exactly the timeout after the last event
        (T0 + 300.0, {"b1": T0 + 100.0}, False),  # an event this leader saw restarts the silence
        (T0 + 340.0, {"b1": T0 + 100.0}, True),
    ],
)
def test_running_build_is_lost_after_the_timeout_from_its_last_event(
    now: float, seen: dict[str, float], lost: bool
) -> None:
    b1 = seed.build("b1", status=RUNNING, node_id="builder-a", last_event_at=T0)
    result = plan([b1], [seed.builder_node("builder-a")], now=now, seen=seen)
    assert (result.lost == ("b1",)) is lost
    if not lost:
        assert result.next_deadline == max([T0, *seen.values()]) + 240.0


def test_queued_builds_go_in_id_order_up_to_the_cap_and_busy_builds_do_not_warn() -> None:
    builds = [seed.build(f"b{i}") for i in (3, 1, 2)]
    builds.sort(key=lambda b: b.meta.id)
    result = plan(builds, [seed.builder_node("builder-a")])
    assert [(d.build_id, d.node_id) for d in result.dispatch] == [("b1", "builder-a"), ("b2", "builder-a")]
    assert result.waiting == ()


def test_running_builds_count_as_load_even_those_of_a_previous_leader() -> None:
    running = seed.build("b0", status=RUNNING, node_id="builder-a", last_event_at=T0)
    result = plan([running, seed.build("b1")], [seed.builder_node("builder-a"), seed.builder_node("builder-b")])
    assert [(d.build_id, d.node_id) for d in result.dispatch] == [("b1", "builder-b")]


def test_queued_build_without_any_builder_waits_with_the_reference_message() -> None:
    result = plan([seed.build("b1")], [seed.builder_node("builder-a", cordoned=True)])
    assert [(w.build_id, w.message) for w in result.waiting] == [
        ("b1", "no schedulable builder node (cordoned, down, or builder=false); the build stays queued")
    ]
    assert result.dispatch == ()


# ---------------------------------------------------------------------------------------- events → outcome


@pytest.mark.parametrize(
    ("events", "verdict"),
    [
        ([cpb.BuildEvent(log=pb.LogLine(line="x"))], None),
        ([cpb.BuildEvent(status=SUCCEEDED, image_digest="sha256:abc")], None),  # success is decided at the end
        (
            [cpb.BuildEvent(error="fetch source: source fetch: HTTP 404")],
            Verdict(FAILED, "fetch source: source fetch: HTTP 404"),
        ),
        ([cpb.BuildEvent(status=FAILED)], Verdict(FAILED, "build failed")),
        ([cpb.BuildEvent(done=True)], Verdict(FAILED, "build ended without producing an image")),
        ([cpb.BuildEvent(image_digest="sha256:abc", error="boom")], Verdict(FAILED, "boom")),  # error beats digest
        (
            [
                cpb.BuildEvent(status=SUCCEEDED, image_digest="sha256:abc", platforms=["linux/arm64"]),
                cpb.BuildEvent(done=True),
            ],
            Verdict(SUCCEEDED, digest="sha256:abc", platforms=("linux/arm64",)),
        ),
        (
            [cpb.BuildEvent(image_digest="sha256:old"), cpb.BuildEvent(image_digest="sha256:new", done=True)],
            Verdict(SUCCEEDED, digest="sha256:new"),  # the last digest wins
        ),
    ],
)
def test_events_decide_the_outcome_with_the_reference_texts(
    events: list[cpb.BuildEvent], verdict: Verdict | None
) -> None:
    progress = StreamProgress()
    results = [apply_event(progress, e) for e in events]
    assert results[-1] == verdict
    assert all(r is None for r in results[:-1])


def test_dispatcher_config_takes_the_builds_settings_of_its_fields() -> None:
    settings = BuildsSettings(
        source_url_base="https://ctrl:8443/internal/blobs/",
        registry_addr="ctrl:5000",
        local_load=True,
        builder_lost_timeout=60.0,
        builder_concurrency=3,
        checkpoint_interval=5.0,
        keep_releases=2,
    )
    assert BuildDispatcherConfig.of(settings) == BuildDispatcherConfig(
        source_url_base="https://ctrl:8443/internal/blobs/",
        registry_addr="ctrl:5000",
        local_load=True,
        builder_lost_timeout=60.0,
        builder_concurrency=3,
        checkpoint_interval=5.0,
    )
    assert BuildDispatcherConfig.of(BUILDS_DEFAULTS) == BuildDispatcherConfig()


@pytest.mark.parametrize(
    ("config", "verdict", "image_ref", "platforms"),
    [
        (
            BuildDispatcherConfig(registry_addr="ctrl:5000"),
            Verdict(SUCCEEDED, digest="sha256:abc"),
            "ctrl:5000/proj1/app1@sha256:abc",
            ["linux/amd64"],
        ),
        (
            BuildDispatcherConfig(),
            Verdict(SUCCEEDED, digest="sha256:abc", platforms=("linux/arm64",)),
            "proj1/app1@sha256:abc",
            ["linux/arm64"],
        ),
        (
            BuildDispatcherConfig(registry_addr="host.docker.internal:5001", local_load=True),
            Verdict(SUCCEEDED, digest="sha256:abc"),
            "host.docker.internal:5001/proj1/app1:b1",
            ["linux/amd64"],
        ),
        (BuildDispatcherConfig(), Verdict(FAILED, BUILDER_LOST), "", ["linux/amd64"]),
    ],
)
def test_outcome_records_digest_pinned_ref_local_load_tag_or_error(
    config: BuildDispatcherConfig, verdict: Verdict, image_ref: str, platforms: list[str]
) -> None:
    running = seed.build("b1", status=RUNNING, node_id="builder-a", platforms=["linux/amd64"])
    done = finished_build(running, verdict, config, T0)
    assert (done.status, done.image_ref, list(done.platforms), done.error) == (
        verdict.status,
        image_ref,
        platforms,
        verdict.error,
    )
    assert done.finished_at.seconds == int(T0)


def test_request_carries_source_location_and_a_lower_case_push_ref() -> None:
    build = seed.build("01JABCDEFGHJKMNPQRSTVWXYZ0")
    build.project_id, build.app_id = "01JPROJECT", "01JAPP"
    request = run_request(
        build, BuildDispatcherConfig(source_url_base="https://ctrl:8443/internal/blobs/", registry_addr="Ctrl:5000")
    )
    assert request.source_url == "https://ctrl:8443/internal/blobs/sha256:deadbeef"
    assert request.push_image_ref == "ctrl:5000/01jproject/01japp:01jabcdefghjkmnpqrstvwxyz0"
    assert not request.HasField("git")


def test_git_build_request_carries_the_clone_source_instead_of_a_bogus_url() -> None:
    build = seed.build("b1", tarball_digest="")
    build.git_clone_url, build.git_sha = "https://github.com/o/r.git", "abc"
    request = run_request(build, BuildDispatcherConfig(source_url_base="https://ctrl:8443/internal/blobs/"))
    assert (request.source_url, request.git.clone_url, request.git.ref) == ("", "https://github.com/o/r.git", "abc")


# ---------------------------------------------------------------------------------------- following builds


def test_following_resumes_running_builds_and_lets_go_of_ended_or_moved_ones() -> None:
    builds = {
        "ran": seed.build("ran", status=RUNNING, node_id="a"),
        "moved": seed.build("moved", status=RUNNING, node_id="b"),
        "canceled": seed.build("canceled", status=pb.BUILD_STATUS_CANCELED, node_id="a"),
        "concluding": seed.build("concluding", status=pb.BUILD_STATUS_CANCELED, node_id="a"),
        "new": seed.build("new", status=RUNNING, node_id="a"),
        "unplaced": seed.build("unplaced", status=RUNNING),
    }
    followed = {
        "ran": Followed("a", concluding=False),
        "moved": Followed("a", concluding=False),
        "canceled": Followed("a", concluding=False),
        "concluding": Followed("a", concluding=True),  # finishes itself
        "gone": Followed("a", concluding=False),
    }
    result = plan_following(builds.values(), builds.get, followed)
    assert result == FollowPlan(
        let_go=("moved", "canceled", "gone"),
        wrap_up=(("canceled", pb.BUILD_STATUS_CANCELED),),
        follow=("moved", "new"),
    )


@pytest.mark.parametrize(
    ("status", "node_id", "live", "done", "route"),
    [
        (RUNNING, "a", False, False, EventRoute.FOLLOW),
        (RUNNING, "", True, False, EventRoute.IGNORE),  # not placed: nobody to follow
        (pb.BUILD_STATUS_CANCELED, "a", True, False, EventRoute.STOP_BUILDER),
        (FAILED, "a", True, False, EventRoute.STOP_BUILDER),
        (FAILED, "a", False, False, EventRoute.IGNORE),  # replayed: the builder may be long done
        (FAILED, "a", True, True, EventRoute.IGNORE),  # its last word
        (None, "", True, False, EventRoute.IGNORE),  # unknown build
    ],
)
def test_an_event_of_a_build_nobody_follows_is_followed_stops_the_builder_or_is_dropped(
    status: int | None, node_id: str, live: bool, done: bool, route: EventRoute
) -> None:
    build = None if status is None else seed.build("b1", status=status, node_id=node_id)
    assert route_unfollowed_event(build, cpb.BuildEvent(done=done), live=live) is route


def test_event_time_checkpoints_and_resend_on_resume_follow_the_clock() -> None:
    assert event_time(live=True, stored_at=T0 - 50, now=T0) == T0
    assert event_time(live=False, stored_at=T0 - 50, now=T0) == T0 - 50
    assert event_time(live=False, stored_at=T0 + 5, now=T0) == T0  # a server clock ahead: never later than now
    assert not checkpoint_due(T0 + 14.9, T0, 15.0)
    assert checkpoint_due(T0 + 15.0, T0, 15.0)
    claimed = seed.build("b1", status=RUNNING, node_id="a", last_event_at=T0)
    assert resend_on_resume(claimed, T0 + CLAIM_IN_FLIGHT - 0.1)
    assert not resend_on_resume(claimed, T0 + CLAIM_IN_FLIGHT)


# ---------------------------------------------------------------------------------------- retention


def env(active: str = "") -> pb.Environment:
    e = pb.Environment(active_release_id=active)
    e.meta.id = "env"
    return e


@pytest.mark.parametrize(
    ("n", "active", "deployments", "kept"),
    [
        (15, "rel-15", [("rel-2", pb.DEPLOYMENT_PHASE_HEALTHCHECKING)], {*(f"rel-{i}" for i in range(6, 16)), "rel-2"}),
        (12, "rel-11", [], {f"rel-{i}" for i in range(3, 13)}),  # active and previous are inside the window
        (15, "rel-3", [], {*(f"rel-{i}" for i in range(6, 16)), "rel-3", "rel-2"}),  # previous = highest below active
        (15, "", [("rel-1", pb.DEPLOYMENT_PHASE_SUCCEEDED)], {f"rel-{i}" for i in range(6, 16)}),  # terminal: no hold
        (15, "", [("rel-1", pb.DEPLOYMENT_PHASE_DRAINING_OLD)], {*(f"rel-{i}" for i in range(6, 16)), "rel-1"}),
        (5, "", [], {f"rel-{i}" for i in range(1, 6)}),
    ],
)
def test_retention_keeps_newest_ten_active_previous_and_non_terminal_deployments(
    n: int, active: str, deployments: list[tuple[str, int]], kept: set[str]
) -> None:
    releases = [seed.release(i) for i in range(1, n + 1)]
    deps = [seed.deployment(f"d{i}", rid, phase) for i, (rid, phase) in enumerate(deployments)]
    prunes = retention.evaluate(envs={"env": env(active)}, releases=releases, deployments=deps, images=[])
    assert {r.meta.id for r in releases} - {p.release_id for p in prunes} == kept


def image(repo: str, tag: str, digest: str) -> pb.Image:
    i = pb.Image(repo=repo, tag=tag, digest=digest, blob_digests=[digest])
    i.meta.id = image_id(repo, tag)
    return i


def test_retention_untags_images_of_upload_builds_with_upper_case_ulids() -> None:
    build_id = "01JBUILDAAAAAAAAAAAAAAAAAA"
    old = seed.release(1, build_id="", image_ref="proj/app@sha256:d1")  # CLI upload: no source.build_id
    deps = [seed.deployment("d1", "rel-1", pb.DEPLOYMENT_PHASE_SUCCEEDED, build_id=build_id)]
    newer = [seed.release(i) for i in range(2, 12)]
    img = image("proj/app", build_id.lower(), "sha256:d1")
    [prune] = retention.evaluate(envs={"env": env()}, releases=[old, *newer], deployments=deps, images=[img])
    assert (prune.release_id, prune.image_ids) == ("rel-1", (img.meta.id,))


def test_retention_keeps_an_image_a_remaining_release_still_deploys() -> None:
    old = seed.release(1, image_ref="proj/app@sha256:d1")
    by_build = [seed.release(i, build_id="", image_ref="proj/app@sha256:d1" if i == 11 else "") for i in range(2, 12)]
    img = image("proj/app", "build-1", "sha256:d1")
    [prune] = retention.evaluate(envs={"env": env()}, releases=[old, *by_build], deployments=[], images=[img])
    assert (prune.release_id, prune.image_ids) == ("rel-1", ())


def test_retention_prunes_a_deleted_environments_releases_except_those_replicas_still_use() -> None:
    releases = [seed.release(i) for i in range(1, 15)]
    prunes = retention.evaluate(envs={}, releases=releases, deployments=[], images=[], in_use=frozenset({"rel-14"}))
    assert [p.release_id for p in prunes] == [f"rel-{i}" for i in range(13, 0, -1)]


def test_a_deleted_environments_finished_deployments_and_builds_go_after_its_last_release() -> None:
    done = seed.deployment("d-1", "rel-1", pb.DEPLOYMENT_PHASE_SUCCEEDED)
    live = seed.deployment("d-2", "rel-2", pb.DEPLOYMENT_PHASE_PLACING)
    finished, running = (
        seed.build("b-1", status=pb.BUILD_STATUS_FAILED),
        seed.build("b-2", status=pb.BUILD_STATUS_RUNNING),
    )
    for b in (finished, running):
        b.environment_id = "env"
    everything = ([done, live], [finished, running])
    assert retention.deleted_env_leftovers({}, [seed.release(1)], *everything) == []
    assert retention.deleted_env_leftovers({"env": env()}, [], *everything) == []
    assert retention.deleted_env_leftovers({}, [], *everything) == ["deployment.d-1", "build.b-1"]


def blob(digest: str, written_at: float) -> BlobInfo:
    return BlobInfo(digest=digest, size=1, written_at=written_at, revision=1, nuid="n", meta={})


@pytest.mark.parametrize(
    ("written_at", "build_status", "stale"),
    [
        (T0 - 25 * 3600, None, True),
        (T0 - 24 * 3600, None, False),  # strictly older than 24 h
        (T0, None, False),
        (T0 - 25 * 3600, QUEUED, False),  # a queued build still needs it
        (T0 - 25 * 3600, RUNNING, False),
        (T0 - 25 * 3600, FAILED, True),
    ],
)
def test_source_tarballs_older_than_a_day_go_unless_a_live_build_needs_them(
    written_at: float, build_status: int | None, stale: bool
) -> None:
    builds = [seed.build("b1", status=build_status, tarball_digest="sha256:t")] if build_status else []
    assert bool(retention.stale_sources([blob("sha256:t", written_at)], builds, now=T0)) is stale


# ---------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "text", ["", "sha256:", "sha256:zz", "md5:" + "a" * 64, "a" * 64, "sha256:" + "g" * 64, "sha256:" + "a" * 63]
)
def test_parse_digest_rejects_anything_but_sha256_and_64_hex(text: str) -> None:
    with pytest.raises(InvalidDigest):
        parse_digest(text)


def test_parse_digest_accepts_and_lower_cases_sha256() -> None:
    assert parse_digest("sha256:" + "AB" * 32) == "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("ref", "registry", "repo", "tag", "digest"),
    [
        ("ctrl:5000/proj1/app1@sha256:abc", "ctrl:5000", "proj1/app1", "", "sha256:abc"),
        ("ctrl:5000/proj1/app1:b1", "ctrl:5000", "proj1/app1", "b1", ""),
        ("proj/app:01JABC", "", "proj/app", "01jabc", ""),
        ("localhost/PROJ/app", "localhost", "proj/app", "", ""),
    ],
)
def test_parse_ref_splits_registry_repo_tag_and_digest(
    ref: str, registry: str, repo: str, tag: str, digest: str
) -> None:
    assert parse_ref(ref) == (parse_ref(ref).__class__(registry, repo, tag, digest))


@pytest.mark.parametrize(
    ("digest", "age", "expected"),
    [
        ("sha256:free", 901.0, True),
        ("sha256:free", 899.0, False),  # written within the grace period
        ("sha256:kept", 10_000.0, False),  # referenced by a tag
    ],
)
def test_blob_is_collectable_when_unreferenced_and_older_than_the_grace(
    digest: str, age: float, expected: bool
) -> None:
    marks = referenced_blobs([image("proj/app", "t", "sha256:kept")])
    assert collectable(blob(digest, T0 - age), marks, now=T0, grace=900.0) is expected
