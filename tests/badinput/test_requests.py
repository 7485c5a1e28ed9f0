"""Bad requests never crash a responder, and every responder still answers a valid request afterwards (DESIGN
§5): random bytes and valid-but-absurd requests of the right type (extreme ints, unknown enum numbers, odd
unicode, huge repeated fields; absurd JSON objects for the join service), with absurd headers, on every
request subject a service or the agent answers — ``zattera.activate``, ``zattera.routes.get``,
``zattera.agent.<node>.{snapshot,restore,prune,build,build.cancel}``, ``zattera.join``,
``zattera.join.issue`` — and random and absurd build events on ``zattera.builds.<id>.events``.

Safety: the agent runs a snapshot's ``pre_hook_command`` with ``/bin/sh`` and removes and renames
directories named after volume, snapshot and build ids. Every request sent here is harmless by
construction, whatever the agent does with it: pre-hooks are empty or ``true``, ids that name paths are
plain ids (or empty) under the rig's own data directory, source URLs are never fetched over HTTP. A random
payload that happens to decode into anything else is not sent (``assume``). The path-traversal regression
test aims only inside the rig's temporary directory.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.activation import ERROR_CODE_HEADER
from shared.buildlogs import ERROR_HEADER, read_build_log
from shared.ids import new_id
from shared.registry import BlobStore
from shared.routewire import CHUNK_HEADER, UNCHANGED_HEADER, decode_body
from shared.security.join import USER_PUBLIC_KEY
from shared.security.nkeyjwt import KeyKind, KeyPair, decode_claims
from shared.security.permissions import JOIN_ISSUE_SUBJECT, JOIN_SUBJECT
from shared.subjects import (
    ACTIVATE_SUBJECT,
    BUILD_EVENTS_STREAM,
    ROUTES_GET_SUBJECT,
    SOURCES_STORE,
    agent_subject,
    build_events_subject,
)
from tests.badinput.rig import AGENT_NODE, PROGRESS_DONE, Rig
from tests.badinput.strategies import ABSURD_HEADERS, IDS, absurd, json_object
from tests.factories import source_tarball
from tests.waiting import eventually

EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    # No shrinking: a responder that stops answering fails every later example too, so shrinking would only
    # hide the request that broke it (each example probes its responder right after, see ``probe``).
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
SNAPSHOT, RESTORE, PRUNE, BUILD, CANCEL = (
    agent_subject(AGENT_NODE, verb) for verb in ("snapshot", "restore", "prune", "build", "build.cancel")
)
ABSURD_VOLUME = "absurd-vol"
"""A small real volume directory that absurd snapshots may read and absurd restores may replace."""
ABSURD_PREFIX = "absurd/"
"""Absurd snapshot requests use object names under this prefix only (the valid ones use ``valid-…/``)."""
MAX_REQUEST = 900_000  # under the server's 1 MiB max_payload
_PLAIN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_ids = itertools.count(1)


# ------------------------------------------------------------------------------------------ harmlessness


def _path_safe(value: str) -> bool:
    """An id the agent may join to one of its directories without leaving it ("" = the directory itself)."""
    return value == "" or _PLAIN_ID.fullmatch(value) is not None


def harmless(subject: str, data: bytes) -> bool:
    """Whatever the agent does with this request, it runs no command but ``true`` and touches no file outside
    the rig's directory (checked on the decoded request, independently of the agent's own checks)."""
    decoders: dict[str, Callable[[bytes], Message]] = {
        SNAPSHOT: cpb.SnapshotVolumeRequest.FromString,
        RESTORE: cpb.RestoreVolumeRequest.FromString,
        BUILD: cpb.RunBuildRequest.FromString,
    }
    if subject not in decoders:
        return True  # prune, cancel, activate, routes.get, join: no shell, no path from the request
    try:
        req = decoders[subject](data)
    except (DecodeError, ValueError, RuntimeError):
        return True  # undecodable: refused
    if isinstance(req, cpb.SnapshotVolumeRequest):
        return req.pre_hook_command in ("", "true") and all(
            _path_safe(i) for i in (req.volume.meta.id, req.snapshot.meta.id)
        )
    if isinstance(req, cpb.RestoreVolumeRequest):
        return all(_path_safe(i) for i in (req.volume.meta.id, req.manifest_key, req.snapshot_id))
    assert isinstance(req, cpb.RunBuildRequest)
    return _path_safe(req.build.meta.id) and not req.source_url.lower().startswith(("http:", "https:"))


# ------------------------------------------------------------------------- valid-but-absurd requests


VOLUME_IDS = st.one_of(st.just(ABSURD_VOLUME), IDS.map(lambda i: f"absurd-{i}"))
SNAPSHOT_IDS = st.one_of(st.just(""), IDS)


@st.composite
def snapshot_requests(draw: st.DrawFn) -> bytes:
    req = draw(absurd(cpb.SnapshotVolumeRequest, huge=500))
    req.volume.meta.id = draw(VOLUME_IDS)
    req.snapshot.meta.id = draw(SNAPSHOT_IDS)
    req.pre_hook_command = draw(st.sampled_from(["", "true"]))  # never a command of the generator's
    req.target.prefix = ABSURD_PREFIX + req.target.prefix
    return req.SerializeToString()


@st.composite
def restore_requests(draw: st.DrawFn) -> bytes:
    req = draw(absurd(cpb.RestoreVolumeRequest, huge=500))
    req.volume.meta.id = draw(VOLUME_IDS)
    req.manifest_key = draw(SNAPSHOT_IDS)
    req.snapshot_id = draw(SNAPSHOT_IDS)
    req.target.prefix = ABSURD_PREFIX + req.target.prefix
    return req.SerializeToString()


@st.composite
def prune_requests(draw: st.DrawFn) -> bytes:
    req = draw(absurd(cpb.PruneSnapshotsRequest, huge=200))  # each id is a delete: 200, not thousands
    req.target.prefix = ABSURD_PREFIX + req.target.prefix
    return req.SerializeToString()


@st.composite
def build_requests(draw: st.DrawFn) -> bytes:
    req = draw(absurd(cpb.RunBuildRequest, huge=500))
    req.build.meta.id = draw(st.one_of(st.just(""), IDS.map(lambda i: f"absurd-{i}")))
    if req.source_url.lower().startswith(("http:", "https:")):
        req.source_url = "sha256:" + req.source_url  # nothing is fetched from the network
    return req.SerializeToString()


def _serialized(cls: type[Message]) -> st.SearchStrategy[bytes]:
    return absurd(cls, huge=500).map(lambda m: m.SerializeToString())


def _json(fields: list[str]) -> st.SearchStrategy[bytes]:
    return json_object(fields).map(lambda o: json.dumps(o).encode())


@st.composite
def join_requests(draw: st.DrawFn) -> bytes:
    """Absurd values, or a well-formed node id and public key with an absurd secret (reaches the token lookup)."""
    request = draw(json_object(["secret", "node_id", "public_key"]))
    if draw(st.booleans()):
        request["node_id"] = draw(IDS)
        request["public_key"] = KeyPair.generate(KeyKind.USER).public_key
    return json.dumps(request).encode()


# ------------------------------------------------------------------------------------------ the answers


def _answers_activate(reply: Msg) -> None:
    if ERROR_CODE_HEADER not in (reply.headers or {}):
        cpb.ActivateResponse.FromString(reply.data)


def _answers_routes(reply: Msg) -> None:
    headers = reply.headers or {}
    if UNCHANGED_HEADER not in headers and CHUNK_HEADER not in headers:
        decode_body(headers, reply.data)


def _answers_build(reply: Msg) -> None:
    assert reply.data == b"", reply.data  # empty: accepted, or refused with the Zattera-Error header


def _answers_prune(reply: Msg) -> None:
    cpb.PruneSnapshotsResponse.FromString(reply.data)


def _answers_cancel(reply: Msg) -> None:
    cpb.CancelBuildResponse.FromString(reply.data)


def _answers_json(reply: Msg) -> None:
    answer = json.loads(reply.data)
    assert isinstance(answer, dict) and (
        isinstance(answer.get("error"), str) or "token" in answer or "jwt" in answer
    ), answer


@dataclass(frozen=True)
class Responder:
    absurd: st.SearchStrategy[bytes]
    check: Callable[[Msg], None] | None = None
    """Checks the one reply; None = a progress stream (snapshot, restore) that must end done or error."""


RESPONDERS: dict[str, Responder] = {
    ACTIVATE_SUBJECT: Responder(_serialized(cpb.ActivateRequest), _answers_activate),
    ROUTES_GET_SUBJECT: Responder(_serialized(cpb.WatchRoutesRequest), _answers_routes),
    SNAPSHOT: Responder(snapshot_requests()),
    RESTORE: Responder(restore_requests()),
    PRUNE: Responder(prune_requests(), _answers_prune),
    BUILD: Responder(build_requests(), _answers_build),
    CANCEL: Responder(_serialized(cpb.CancelBuildRequest), _answers_cancel),
    JOIN_ISSUE_SUBJECT: Responder(_json(["ttl", "node_id", "builder"]), _answers_json),
    JOIN_SUBJECT: Responder(join_requests(), _answers_json),
}


def assert_alive(rig: Rig) -> None:
    dead = rig.dead()
    assert not dead, f"processes died: {dead}"


def probe(rig: Rig, subject: str) -> None:
    """A valid request to the process behind ``subject`` is still answered at once: a process can outlive
    its NATS connection (the server drops a client that sends a subject over its 4 KiB control line, and
    nats-py then closes for good), so "the pid is alive" is not enough."""
    if subject.startswith(f"zattera.agent.{AGENT_NODE}."):
        cpb.CancelBuildResponse.FromString(rig.run(rig.ask(CANCEL, b"", timeout=5.0)).data)
    elif subject in (JOIN_SUBJECT, JOIN_ISSUE_SUBJECT):
        _answers_json(rig.run(rig.ask(JOIN_SUBJECT, b"{}", timeout=5.0)))
    elif subject == ACTIVATE_SUBJECT:
        body = cpb.ActivateRequest(environment_id="probe").SerializeToString()
        _answers_activate(rig.run(rig.ask(ACTIVATE_SUBJECT, body, timeout=5.0)))
    else:
        body = cpb.WatchRoutesRequest().SerializeToString()
        _answers_routes(rig.run(rig.ask(ROUTES_GET_SUBJECT, body, timeout=5.0)))


def exercise(rig: Rig, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
    """Send one request; the responder answers it well-formed, and its process still answers the next valid
    request."""
    responder = RESPONDERS[subject]
    verb = subject.removeprefix(f"zattera.agent.{AGENT_NODE}.").removeprefix("zattera.")
    if responder.check is None:
        progress = rig.run(rig.progress(subject, data, headers))
        assert progress[-1].phase in PROGRESS_DONE
        assert [p.sequence for p in progress] == sorted(p.sequence for p in progress)
        event(f"{verb}: {progress[-1].phase}")
    else:
        reply = rig.run(rig.ask(subject, data, headers))
        responder.check(reply)
        refused = (reply.headers or {}).keys() & {ERROR_HEADER, ERROR_CODE_HEADER} or b'"error"' in reply.data
        event(f"{verb}: {'refused' if refused else 'answered'}")
    assert_alive(rig)
    probe(rig, subject)


@pytest.fixture(scope="module")
def absurd_volume(rig: Rig) -> None:
    directory = rig.volumes_dir / ABSURD_VOLUME
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "data.txt").write_text("absurd volume\n")


SUBJECTS = pytest.mark.parametrize("subject", sorted(RESPONDERS), ids=lambda s: s.removeprefix("zattera."))


@SUBJECTS
@settings(EXAMPLES, max_examples=8)
@given(
    data=st.one_of(st.binary(max_size=500), st.binary(min_size=4096, max_size=65536)),
    headers=st.one_of(st.none(), ABSURD_HEADERS),
)
def test_random_bytes_on_every_request_subject(
    rig: Rig, absurd_volume: None, subject: str, data: bytes, headers: dict[str, str] | None
) -> None:
    assume(harmless(subject, data))
    exercise(rig, subject, data, headers)


@SUBJECTS
@settings(EXAMPLES, max_examples=12)
@given(data=st.data(), headers=st.one_of(st.none(), ABSURD_HEADERS))
def test_absurd_requests_on_every_request_subject(
    rig: Rig, absurd_volume: None, subject: str, data: st.DataObject, headers: dict[str, str] | None
) -> None:
    body = data.draw(RESPONDERS[subject].absurd, label="request")
    assume(len(body) < MAX_REQUEST)
    assert harmless(subject, body)  # by construction
    exercise(rig, subject, body, headers)


# ------------------------------------------------------------------------------------------ build events


DIGEST = "sha256:" + "ab" * 32


def running_build(build_id: str) -> pb.Build:
    b = pb.Build(project_id="bad-proj", app_id="bad-app", environment_id="bad-env", status=pb.BUILD_STATUS_RUNNING)
    b.meta.id = build_id
    b.node_id = AGENT_NODE
    # Claimed a minute ago: a build claimed moments ago is sent its RunBuild again by a dispatcher that
    # resumes it (dispatcher.CLAIM_IN_FLIGHT), and this one has no source for the builder to fetch.
    b.started_at.FromSeconds(int(time.time()) - 60)
    b.last_event_at.GetCurrentTime()
    return b


def closing_event(build_id: str) -> cpb.BuildEvent:
    """A builder's good ending in one event (a log line, the digest, done): re-sent whole, it cannot be half
    seen by a dispatcher that learns of the build between two events."""
    return cpb.BuildEvent(
        build_id=build_id,
        sequence=1,
        log=pb.LogLine(line="valid line"),
        status=pb.BUILD_STATUS_SUCCEEDED,
        image_digest=DIGEST,
        platforms=["linux/amd64"],
        done=True,
    )


def concludes(data: bytes) -> bool:
    """Would this payload, as a build event, end its build (the dispatcher's rules)?"""
    try:
        event = cpb.BuildEvent.FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        return False
    return bool(event.error) or event.status == pb.BUILD_STATUS_FAILED or event.done


async def conclude_with_a_valid_event(rig: Rig, build_id: str) -> pb.Build:
    """Publish the closing event until the build is terminal (re-sent while the builds service's view may not
    hold the build yet: an event for a build it does not know is dropped)."""
    terminal = (pb.BUILD_STATUS_SUCCEEDED, pb.BUILD_STATUS_FAILED, pb.BUILD_STATUS_CANCELED)

    async def ended() -> bool:
        b = rig.view.build(build_id)
        if b is not None and b.status in terminal:
            return True
        await rig.conn.js.publish(
            build_events_subject(build_id, AGENT_NODE), closing_event(build_id).SerializeToString()
        )
        feed = rig.view.subscribe({K.BUILD})
        try:
            await feed.wait(timeout=0.5)
        finally:
            feed.close()
        b = rig.view.build(build_id)
        return b is not None and b.status in terminal

    await eventually(ended, 20, f"build {build_id} concluded")
    build = rig.view.build(build_id)
    assert build is not None
    return build


@pytest.fixture(scope="module")
def ended_build(rig: Rig) -> str:
    """A build that has ended: events for it make the dispatcher tell its builder to stop."""
    build = running_build(f"ended-{new_id()}")
    build.status = pb.BUILD_STATUS_SUCCEEDED
    rig.run(rig.writer.commit(rig.writer.txn("badinput").put(build)))
    return build.meta.id


@EXAMPLES
@given(
    garbage=st.one_of(st.binary(max_size=300), absurd(cpb.BuildEvent, huge=300).map(lambda m: m.SerializeToString())),
    stray=IDS,
)
def test_random_and_absurd_build_events(rig: Rig, ended_build: str, garbage: bytes, stray: str) -> None:
    """Garbage on a build nobody runs, on an ended build and on a running one; the running build still ends by
    its builder's next valid events (SUCCEEDED with their digest unless the garbage itself was an ending)."""
    build_id = f"ev-{new_id()}"

    async def go() -> pb.Build:
        await rig.writer.commit(rig.writer.txn("badinput").put(running_build(build_id)))
        for target in (f"stray-{stray}", ended_build, build_id):
            await rig.conn.js.publish(build_events_subject(target, AGENT_NODE), garbage)
        return await conclude_with_a_valid_event(rig, build_id)

    build = rig.run(go())
    if not concludes(garbage):
        assert build.status == pb.BUILD_STATUS_SUCCEEDED, build
        assert build.image_digest == DIGEST
        assert "valid line" in rig.run(read_build_log(rig.conn, build_id))
    assert_alive(rig)


# ------------------------------------------------------------------------------------------ path traversal


def test_agent_requests_whose_ids_are_paths_are_refused_and_touch_nothing(rig: Rig) -> None:
    """Bug fixed with this suite: the agent joined request ids to its directories unchecked. A build id
    ``../x`` (or an absolute path) made the builder ``rmtree`` that directory after the build; a volume id
    that is an absolute path made a snapshot upload any directory and a restore swap it out; a snapshot id
    with ``/`` named the staging directory a restore clears first. Every target here is inside the rig."""
    canary = rig.agent_dir / "canary"
    canary.mkdir(parents=True, exist_ok=True)
    (canary / "keep.txt").write_text("keep me\n")

    async def go() -> None:
        for build_id in ("../canary", str(canary), "..", "."):
            req = cpb.RunBuildRequest(build=pb.Build(meta=pb.Meta(id=build_id)), source_url="sha256:00")
            reply = await rig.ask(BUILD, req.SerializeToString())
            assert "build id" in (reply.headers or {}).get(ERROR_HEADER, ""), (build_id, reply.headers)

        snapshot = cpb.SnapshotVolumeRequest(
            volume=pb.Volume(meta=pb.Meta(id=str(canary))), snapshot=pb.VolumeSnapshot(meta=pb.Meta(id="s1"))
        )
        restores = [
            cpb.RestoreVolumeRequest(volume=pb.Volume(meta=pb.Meta(id="../canary")), snapshot_id="s1"),
            cpb.RestoreVolumeRequest(volume=pb.Volume(meta=pb.Meta(id="v1")), snapshot_id="x/../../canary"),
            cpb.RestoreVolumeRequest(volume=pb.Volume(meta=pb.Meta(id="v1")), manifest_key=str(canary)),
        ]
        requests: list[tuple[str, Message]] = [(SNAPSHOT, snapshot), *((RESTORE, r) for r in restores)]
        for subject, request in requests:
            progress = await rig.progress(subject, request.SerializeToString())
            assert [p.phase for p in progress] == ["error"], progress
            assert re.search(r"(volume|snapshot) id", progress[0].error), progress[0].error

    rig.run(go())
    assert (canary / "keep.txt").read_text() == "keep me\n"
    assert_alive(rig)


def test_agent_requests_that_would_overflow_a_subject_are_refused_and_the_agent_stays_connected(
    rig: Rig, absurd_volume: None
) -> None:
    """Bug fixed with this suite: a snapshot target's bucket name or prefix, or a snapshot id, of a few KiB
    went into an object-store subject; the server dropped the agent's connection ("maximum control line
    exceeded") and nats-py closed it for good: the agent ran on, deaf (no heartbeats, no requests)."""
    volume = pb.Volume(meta=pb.Meta(id=ABSURD_VOLUME))
    snapshot = pb.VolumeSnapshot(meta=pb.Meta(id="s1"))
    long = "x" * 5000
    targets = [cpb.SnapshotTarget(object_store=long), cpb.SnapshotTarget(prefix=long)]

    async def go() -> None:
        for target in targets:
            for subject, request in [
                (SNAPSHOT, cpb.SnapshotVolumeRequest(volume=volume, snapshot=snapshot, target=target)),
                (RESTORE, cpb.RestoreVolumeRequest(volume=volume, snapshot_id="s1", target=target)),
            ]:
                progress = await rig.progress(subject, request.SerializeToString(), timeout=5.0)
                assert [p.phase for p in progress] == ["error"], progress
                assert re.search("object store|prefix", progress[0].error), progress[0].error
            bad_target = cpb.PruneSnapshotsRequest(target=target).SerializeToString()
            refused = cpb.PruneSnapshotsResponse.FromString((await rig.ask(PRUNE, bad_target)).data)
            assert "bad request" in refused.error, refused
        long_id = cpb.PruneSnapshotsRequest(snapshot_ids=[long], target=cpb.SnapshotTarget(prefix="absurd/"))
        refused = cpb.PruneSnapshotsResponse.FromString((await rig.ask(PRUNE, long_id.SerializeToString())).data)
        assert "snapshot id" in refused.error, refused
        restore = cpb.RestoreVolumeRequest(volume=volume, snapshot_id=long)
        progress = await rig.progress(RESTORE, restore.SerializeToString(), timeout=5.0)
        assert "snapshot id" in progress[-1].error, progress

    rig.run(go())
    probe(rig, SNAPSHOT)
    assert_alive(rig)


# ------------------------------------------------------------------------------------------ the known bug


def test_join_issue_names_a_huge_ttl(rig: Rig) -> None:
    reply = rig.run(rig.ask(JOIN_ISSUE_SUBJECT, b'{"ttl": 1' + b"0" * 400 + b"}", timeout=1.0))
    assert "ttl" in json.loads(reply.data)["error"]


# ------------------------------------------------------------------------------------------ afterwards


async def build_events(rig: Rig, build_id: str, until: Callable[[cpb.BuildEvent], bool]) -> list[cpb.BuildEvent]:
    """The build's events from the first, up to the one ``until`` accepts or the last (``done``)."""
    sub = await rig.conn.js.subscribe(
        build_events_subject(build_id),
        stream=BUILD_EVENTS_STREAM,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    received: list[cpb.BuildEvent] = []
    try:
        while not received or not (until(received[-1]) or received[-1].done):
            try:
                msg = await sub.next_msg(timeout=30)
            except nats.errors.TimeoutError:
                raise AssertionError(f"build {build_id}: no further event after {received}") from None
            received.append(cpb.BuildEvent.FromString(msg.data))
    finally:
        await sub.unsubscribe()
    return received


def test_after_the_garbage_every_responder_answers_a_valid_request(rig: Rig) -> None:
    """Snapshot → restore → prune of a real volume; a build on the builder and one through the dispatcher
    (its events on ``zattera.builds.<id>.events``); a cancel of a running build; a join token issued and used."""
    assert_alive(rig)
    volume_id = f"valid-vol-{next(_ids)}"
    snapshot_id = new_id()
    target = cpb.SnapshotTarget(prefix=f"valid-{volume_id}/")
    directory = rig.volumes_dir / volume_id
    directory.mkdir(parents=True)
    (directory / "a.txt").write_text("alpha\n")
    (directory / "sub").mkdir()
    (directory / "sub" / "b.bin").write_bytes(bytes(range(256)) * 64)

    async def snapshots() -> None:
        req = cpb.SnapshotVolumeRequest(
            volume=pb.Volume(meta=pb.Meta(id=volume_id)),
            snapshot=pb.VolumeSnapshot(meta=pb.Meta(id=snapshot_id)),
            pre_hook_command="true",
            target=target,
        )
        done = (await rig.progress(SNAPSHOT, req.SerializeToString()))[-1]
        assert (done.phase, done.error, done.manifest_key) == ("done", "", snapshot_id), done

        (directory / "a.txt").write_text("changed\n")
        (directory / "stray.txt").write_text("not in the snapshot\n")
        restore = cpb.RestoreVolumeRequest(volume=req.volume, manifest_key=snapshot_id, target=target)
        done = (await rig.progress(RESTORE, restore.SerializeToString()))[-1]
        assert (done.phase, done.error) == ("done", ""), done

        prune = cpb.PruneSnapshotsRequest(volume=req.volume, snapshot_ids=[snapshot_id], target=target)
        pruned = cpb.PruneSnapshotsResponse.FromString((await rig.ask(PRUNE, prune.SerializeToString())).data)
        assert (pruned.error, pruned.deleted_manifests) == ("", 1), pruned

    rig.run(snapshots(), 60)
    assert (directory / "a.txt").read_text() == "alpha\n"
    assert not (directory / "stray.txt").exists()
    assert (directory / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 64

    async def builds() -> None:
        digest = await BlobStore(rig.conn, SOURCES_STORE).put(source_tarball({"index.html": "hello\n"}))
        # straight to the builder: accepted, then succeeded + done on zattera.builds.<id>.events
        build = pb.Build(project_id="valid-proj", app_id="valid-app", environment_id="valid-env")
        build.meta.id = new_id()
        req = cpb.RunBuildRequest(build=build, source_url=digest, push_image_ref=f"valid/app:{build.meta.id.lower()}")
        reply = await rig.ask(BUILD, req.SerializeToString())
        assert reply.data == b"" and not (reply.headers or {}).get(ERROR_HEADER), reply.headers
        events = await build_events(rig, build.meta.id, lambda e: e.done)
        succeeded = [e.image_digest for e in events if e.status == pb.BUILD_STATUS_SUCCEEDED]
        assert len(succeeded) == 1 and succeeded[0].startswith("sha256:"), events
        assert not any(e.error for e in events), events

        # through the dispatcher: QUEUED → claimed onto the agent → built → SUCCEEDED, its log copied
        queued = pb.Build(project_id="valid-proj", app_id="valid-app", environment_id="valid-env")
        queued.meta.id = new_id()
        queued.status = pb.BUILD_STATUS_QUEUED
        queued.tarball_digest = digest
        await rig.writer.commit(rig.writer.txn("badinput").put(queued))

        def finished() -> bool:
            b = rig.view.build(queued.meta.id)
            return b is not None and b.status not in (pb.BUILD_STATUS_QUEUED, pb.BUILD_STATUS_RUNNING)

        await eventually(finished, 60, "the dispatched build finished")
        done = rig.view.build(queued.meta.id)
        assert done is not None and done.status == pb.BUILD_STATUS_SUCCEEDED, done
        assert done.node_id == AGENT_NODE and done.image_digest.startswith("sha256:")
        assert any(line.startswith("fetching source") for line in await read_build_log(rig.conn, queued.meta.id))

        # cancel: a running build (its build command waits) is canceled and reports it
        slow = await BlobStore(rig.conn, SOURCES_STORE).put(
            source_tarball({"zattera.toml": '[build]\ncommand = "sleep 60"\n'})
        )
        build.meta.id = new_id()
        req = cpb.RunBuildRequest(build=build, source_url=slow, push_image_ref=f"valid/app:{build.meta.id.lower()}")
        assert (await rig.ask(BUILD, req.SerializeToString())).data == b""
        started = await build_events(rig, build.meta.id, lambda e: e.log.line == "$ sleep 60")
        assert started[-1].log.line == "$ sleep 60", started
        cancel = cpb.CancelBuildRequest(build_id=build.meta.id).SerializeToString()
        assert cpb.CancelBuildResponse.FromString((await rig.ask(CANCEL, cancel)).data).canceled
        events = await build_events(rig, build.meta.id, lambda e: e.done)
        assert (events[-1].status, events[-1].error) == (pb.BUILD_STATUS_FAILED, "build canceled"), events[-1]

    rig.run(builds(), 120)

    async def joins() -> None:
        issued = json.loads((await rig.ask(JOIN_ISSUE_SUBJECT, json.dumps({"ttl": 600}).encode())).data)
        secret = issued["token"].split(".")[1]
        user = KeyPair.generate(KeyKind.USER)
        node_id = f"joined-{next(_ids)}"
        request = {"secret": secret, "node_id": node_id, "public_key": user.public_key}
        joined = json.loads((await rig.ask(JOIN_SUBJECT, json.dumps(request).encode())).data)
        assert joined.get("node_id") == node_id and joined.get("role") == "agent", joined
        claims = decode_claims(joined["jwt"])
        assert (claims["name"], claims["sub"]) == (node_id, user.public_key)
        assert USER_PUBLIC_KEY.match(claims["sub"])
        again = json.loads((await rig.ask(JOIN_SUBJECT, json.dumps(request).encode())).data)
        assert "already used" in again["error"]

    rig.run(joins())

    async def others() -> None:
        activate = cpb.ActivateRequest(environment_id="nope").SerializeToString()
        _answers_activate(await rig.ask(ACTIVATE_SUBJECT, activate))
        _answers_routes(await rig.ask(ROUTES_GET_SUBJECT, cpb.WatchRoutesRequest().SerializeToString()))

    rig.run(others())
    assert_alive(rig)
