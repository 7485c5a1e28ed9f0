"""Pure logic of snapshots: cron slots, baseline, retention, reaping, lease helpers, tar, chunking,
sealing, manifest format, extraction guards. No I/O beyond temporary directories."""

from __future__ import annotations

import io
import os
import random
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.chunking import TEST_PARAMS, ChunkParams, chunk_lengths
from services.agent.snapshots.manifest import ChunkRef, Manifest
from services.agent.snapshots.tarstream import UnsafeArchiveError, extract, tar_bytes, tree_paths
from services.scheduler.snapshots import (
    expired_failures,
    retention_victims,
    slot_to_fire,
    snapshot_baseline,
    stuck_runs,
)
from shared.schedule import ScheduleError, parse_go_duration, parse_schedule
from shared.snapshots.crypto import Sealer, SealError
from shared.volumes import lease_expired, lease_held_by_other
from tests.snapshots.conftest import BASE, KEY, snap_volume, snapshot_record, stamp, write_tree

H = 3600.0


def utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


# ---------------------------------------------------------------------------- cron


@pytest.mark.parametrize(
    ("schedule", "after", "expected"),
    [
        ("0 * * * *", "2030-01-01T00:00:00", "2030-01-01T01:00:00"),  # strictly after the baseline
        ("0 * * * *", "2030-01-01T01:05:00", "2030-01-01T02:00:00"),
        ("*/15 * * * *", "2030-01-01T00:14:59", "2030-01-01T00:15:00"),
        ("0 3 * * *", "2030-01-01T04:00:00", "2030-01-02T03:00:00"),  # plain cron is UTC
        ("CRON_TZ=America/New_York 0 9 * * *", "2030-01-01T00:00:00", "2030-01-01T14:00:00"),
        ("TZ=Europe/Paris 0 9 * * *", "2030-01-01T00:00:00", "2030-01-01T08:00:00"),
        ("@hourly", "2030-01-01T00:30:00", "2030-01-01T01:00:00"),
        ("@daily", "2030-01-01T00:00:00", "2030-01-02T00:00:00"),
        ("@midnight", "2030-01-01T12:00:00", "2030-01-02T00:00:00"),
        ("@weekly", "2030-01-01T00:00:00", "2030-01-06T00:00:00"),
        ("@monthly", "2030-01-01T00:00:00", "2030-02-01T00:00:00"),
        ("@yearly", "2030-01-01T00:00:00", "2031-01-01T00:00:00"),
        ("@annually", "2030-01-01T00:00:00", "2031-01-01T00:00:00"),
        ("@every 90m", "2030-01-01T00:00:00", "2030-01-01T01:30:00"),
        ("@every 1h30m", "2030-01-01T00:00:00.7", "2030-01-01T01:30:00"),  # sub-second truncated
        ("@every 300ms", "2030-01-01T00:00:00", "2030-01-01T00:00:01"),  # < 1 s rounds up to 1 s
        ("0 0 1 * MON", "2030-01-01T00:00:00", "2030-01-07T00:00:00"),  # dom OR dow when both restricted
        ("0 0 ? * MON", "2030-01-01T00:00:00", "2030-01-07T00:00:00"),
        ("15 9-17/4 * JAN-MAR 1-5", "2030-01-01T10:00:00", "2030-01-01T13:15:00"),
    ],
)
def test_next_slot_follows_robfig_standard_cron(schedule: str, after: str, expected: str) -> None:
    assert parse_schedule(schedule).next_after(utc(after)) == utc(expected)


def test_impossible_cron_has_no_slot_so_never_fires() -> None:
    assert parse_schedule("0 0 30 2 *").next_after(BASE) is None
    assert slot_to_fire(parse_schedule("0 0 30 2 *"), BASE, BASE + 10 * 365 * 24 * H, 0.0) is None


@pytest.mark.parametrize(
    "schedule",
    [
        "0 0 0 * * *",
        "bad",
        "61 * * * *",
        "* * * *",
        "@fortnightly",
        "@every",
        "@every 5x",
        "CRON_TZ=Mars/Base 0 * * * *",
    ],
)
def test_rejected_schedules_raise_schedule_error(schedule: str) -> None:
    with pytest.raises(ScheduleError):
        parse_schedule(schedule)


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("1h30m", 5400), ("1.5h", 5400), ("250ms", 0.25)])
def test_go_durations_parse_to_seconds(text: str, seconds: float) -> None:
    assert parse_go_duration(text) == pytest.approx(seconds)


def test_baseline_is_the_newest_of_volume_creation_and_every_record_status() -> None:
    volume = snap_volume("v", created_at=BASE)
    records = [
        snapshot_record("v", BASE + H),
        snapshot_record("v", BASE + 3 * H, pb.SNAPSHOT_STATUS_FAILED),
        snapshot_record("v", BASE + 2 * H, pb.SNAPSHOT_STATUS_RUNNING),
    ]
    assert snapshot_baseline(volume, []) == BASE
    assert snapshot_baseline(volume, records) == BASE + 3 * H


@pytest.mark.parametrize(
    ("now", "last_fire", "fires"),
    [
        (BASE + 0.5 * H, 0.0, None),  # next slot 01:00 still in the future
        (BASE + 65 * 60, 0.0, BASE + H),
        (BASE + 65 * 60, BASE + H, None),  # already fired this term
        (BASE + 50 * H, 0.0, BASE + H),  # long outage: one catch-up, the first missed slot
    ],
)
def test_slot_fires_once_when_due(now: float, last_fire: float, fires: float | None) -> None:
    assert slot_to_fire(parse_schedule("0 * * * *"), BASE, now, last_fire) == fires


# ---------------------------------------------------------------------------- retention / reaping


@pytest.mark.parametrize(
    ("keep_last", "complete", "expected_dead"),
    [(2, 4, [1, 0]), (0, 9, [1, 0]), (7, 7, []), (3, 2, []), (1, 3, [1, 0])],
)
def test_retention_drops_the_oldest_complete_beyond_keep_last(
    keep_last: int, complete: int, expected_dead: list[int]
) -> None:
    records = [snapshot_record("v", BASE + i * H, snapshot_id=f"s{i}") for i in range(complete)]
    records.append(snapshot_record("v", BASE - H, pb.SNAPSHOT_STATUS_FAILED, snapshot_id="failed"))
    records.append(snapshot_record("v", BASE - 2 * H, pb.SNAPSHOT_STATUS_RUNNING, snapshot_id="running"))
    policy = pb.SnapshotPolicy(keep_last=keep_last)
    assert [r.meta.id for r in retention_victims(records, policy)] == [f"s{i}" for i in expected_dead]


def test_old_failures_expire_but_never_the_newest_record() -> None:
    old_failed = snapshot_record("v", BASE, pb.SNAPSHOT_STATUS_FAILED, snapshot_id="old")
    fresh_failed = snapshot_record("v", BASE + 30 * H, pb.SNAPSHOT_STATUS_FAILED, snapshot_id="fresh")
    newest_failed = snapshot_record("v", BASE + 2 * H, pb.SNAPSHOT_STATUS_FAILED, snapshot_id="newest")
    now = BASE + 31 * H
    assert [r.meta.id for r in expired_failures([old_failed, fresh_failed], now)] == ["old"]
    assert expired_failures([newest_failed], now) == []  # alone: it is the baseline


@pytest.mark.parametrize(
    ("age", "touched_ago", "progress_ago", "stuck"),
    [
        (2 * H, None, None, True),
        (0.5 * H, None, None, False),
        (2 * H, 10 * 60, None, False),  # record refreshed by its follower
        (2 * H, None, 60, False),  # progress seen in memory by this dispatcher
        (2 * H, 1.5 * H, 1.2 * H, True),
    ],
)
def test_running_without_progress_for_an_hour_is_stuck(
    age: float, touched_ago: float | None, progress_ago: float | None, stuck: bool
) -> None:
    now = BASE + 10 * H
    record = snapshot_record("v", now - age, pb.SNAPSHOT_STATUS_RUNNING, snapshot_id="r")
    if touched_ago is not None:
        record.meta.updated_at.CopyFrom(stamp(now - touched_ago))
    progress = {} if progress_ago is None else {"r": now - progress_ago}
    assert stuck_runs([record], now, progress) == (["r"] if stuck else [])


def test_lease_helpers() -> None:
    now = 1_800_000_000.0
    fresh = pb.VolumeLease(node_id="n1", expires_at=stamp(now + 30))
    stale = pb.VolumeLease(node_id="n1", expires_at=stamp(now - 1))
    assert lease_expired(fresh, now) is False
    assert lease_expired(stale, now) is True
    assert lease_expired(None, now) is True
    assert lease_held_by_other(fresh, "n2", now) is True
    assert lease_held_by_other(fresh, "n1", now) is False
    assert lease_held_by_other(stale, "n2", now) is False


# ---------------------------------------------------------------------------- tar


THREE_FILES = {"config.json": b'{"a": 1}', "data/big.bin": bytes(range(256)) * 40, "data/small": b"0123456789"}


def test_deterministic_tar_is_byte_identical_for_identical_trees(tmp_path: Path) -> None:
    write_tree(tmp_path / "one", THREE_FILES)
    write_tree(tmp_path / "two", THREE_FILES)
    assert tar_bytes(tmp_path / "one") == tar_bytes(tmp_path / "two")


def test_tar_paths_sorted_as_plain_strings_root_excluded(tmp_path: Path) -> None:
    write_tree(tmp_path, {"a/b": b"", "a.txt": b"", "B": b"", "a/a": b""})
    assert tree_paths(tmp_path) == ["B", "a", "a.txt", "a/a", "a/b"]


def test_tar_headers_zero_times_and_keep_modes_links(tmp_path: Path) -> None:
    write_tree(tmp_path, {"dir/file": b"x"})
    os.chmod(tmp_path / "dir/file", 0o640)
    os.symlink("/elsewhere/target", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    os.utime(tmp_path / "dir/file", (5.0, 1_700_000_000.9))
    with tarfile.open(fileobj=io.BytesIO(tar_bytes(tmp_path))) as archive:
        members = {m.name: m for m in archive}
    assert sorted(members) == ["dir", "dir/file", "link"]  # fifo skipped; tarfile strips the dir's "/"
    assert members["dir/file"].mtime == 1_700_000_000 and members["dir/file"].mode == 0o640
    assert members["link"].issym() and members["link"].linkname == "/elsewhere/target"
    assert members["dir/file"].uname == "" and members["dir/file"].pax_headers == {}


def test_tar_content_change_with_same_size_and_mtime_changes_stream(tmp_path: Path) -> None:
    write_tree(tmp_path / "t", {"f": b"aaaa"})
    before = tar_bytes(tmp_path / "t")
    write_tree(tmp_path / "t", {"f": b"aaab"})
    assert tar_bytes(tmp_path / "t") != before


def _archive(*members: tuple[tarfile.TarInfo, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


@pytest.mark.parametrize(
    "members",
    [
        [(_member("../escape"), b"x")],
        [(_member("/etc/abs"), b"x")],
        [(_member("a/../../escape"), b"x")],
        [(_member("out", tarfile.SYMTYPE, "/tmp"), b""), (_member("out/escape"), b"x")],  # write through a link
    ],
    ids=["dotdot", "absolute", "nested-dotdot", "through-symlink"],
)
def test_extract_refuses_tar_slip(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    with pytest.raises(UnsafeArchiveError):
        extract(_archive(*members), tmp_path / "dest")
    assert not (tmp_path / "escape").exists()


def test_extract_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    archive = _archive((_member("f", tarfile.SYMTYPE, str(outside)), b""), (_member("f"), b"new"))
    extract(archive, tmp_path / "dest")
    assert outside.read_bytes() == b"keep"
    assert (tmp_path / "dest/f").read_bytes() == b"new"


# ---------------------------------------------------------------------------- chunking


def test_default_chunk_params_are_the_reference_sizes() -> None:
    assert ChunkParams() == ChunkParams(avg=1 << 20, min=256 << 10, max=4 << 20)


@pytest.mark.parametrize(("size", "minimum"), [(512 << 10, 5), (64 << 10, 2)])
def test_chunks_respect_min_and_max(size: int, minimum: int) -> None:
    data = random.Random(size).randbytes(size)
    lengths = chunk_lengths(data, TEST_PARAMS)
    assert sum(lengths) == size and len(lengths) >= minimum
    assert all(TEST_PARAMS.min <= n <= TEST_PARAMS.max for n in lengths[:-1])


@pytest.mark.parametrize("offset", [0, 100 << 10, 200 << 10, (512 << 10) - 1])
def test_one_byte_change_rechunks_locally(offset: int) -> None:
    original = random.Random(7).randbytes(512 << 10)
    data = bytearray(original)
    before = chunk_lengths(original, TEST_PARAMS)
    data[offset] ^= 0xFF
    after = chunk_lengths(bytes(data), TEST_PARAMS)

    def contents(blob: bytes, lengths: list[int]) -> set[bytes]:
        out, pos = set(), 0
        for n in lengths:
            out.add(blob[pos : pos + n])
            pos += n
        return out

    changed = contents(bytes(data), after) - contents(original, before)
    assert 1 <= len(changed) <= 2


# ---------------------------------------------------------------------------- sealing, manifest


def test_crypto_round_trip() -> None:
    sealer = Sealer(KEY)
    plaintext = b"volume data " * 100
    sealed = sealer.seal(plaintext)
    assert sealer.open(sealed) == plaintext
    assert plaintext[:32] not in sealed
    assert sealer.seal(plaintext) != sealed  # fresh nonce per object
    wrong = bytes([KEY[0] ^ 1]) + KEY[1:]
    with pytest.raises(SealError):
        Sealer(wrong).open(sealed)


@pytest.mark.parametrize("length", [16, 31, 33])
def test_key_must_be_32_bytes(length: int) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        Sealer(b"k" * length)


def test_manifest_json_format() -> None:
    manifest = Manifest(chunks=[ChunkRef("ab" * 32, 5)], tar_bytes=5, created_at_unix=int(BASE))
    assert manifest.to_json() == (
        b'{"version":1,"chunks":[{"hash":"' + b"ab" * 32 + b'","size":5}],"tar_bytes":5,"created_at_unix":1893456000}'
    )
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert b'"chunks":null' in Manifest().to_json()
    assert Manifest.from_json(Manifest().to_json()).chunks == []
