"""The pure parts of a backup: the manifest, object checks, the schema rule, what a restore writes, and the
passphrase seal (at libsodium's minimum Argon2id limits, for speed)."""

from __future__ import annotations

import pytest
from nacl import pwhash
from zattera.v1 import types_pb2 as pb

from shared.actions.backup import ZSTD, _compressed, decoded
from shared.backup import recovery
from shared.backup.cluster import BucketCopy, is_empty, restorable
from shared.backup.manifest import (
    STATE,
    Corrupt,
    Entry,
    Manifest,
    TooNew,
    check_object,
    check_restorable,
    parse_manifest,
    sha256,
)

DATA = b"the object"
ENTRY = Entry("sources", "src-1.tar", sha256(DATA), len(DATA), {"description": "d"})


def manifest(schema: int = 2) -> Manifest:
    return Manifest("B1", 1000.0, "0.2.0", schema, 42, "C1", (ENTRY,))


def test_manifest_round_trips() -> None:
    m = manifest()
    assert parse_manifest("B1", m.to_json()) == m
    assert m.summary()["kinds"] == {"sources": 1}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (None, "object sources/src-1.tar (blobs/"),
        (DATA[:-3], "is 7 bytes, expected 10 (truncated?)"),
        (b"THE OBJECT", "does not match its SHA-256 (altered)"),
    ],
)
def test_a_bad_object_is_named(data: bytes | None, problem: str) -> None:
    with pytest.raises(Corrupt, match=r"backup B1: object sources/src-1.tar") as exc:
        check_object("B1", ENTRY, data)
    assert problem in str(exc.value)


def test_a_good_object_passes() -> None:
    assert check_object("B1", ENTRY, DATA) == DATA


@pytest.mark.parametrize("text", [b"not json", b"{}", b'{"entries": [{"kind": 1}]}'])
def test_a_broken_manifest_is_corrupt(text: bytes) -> None:
    with pytest.raises(Corrupt, match=r"backup B1: manifest\.json is not a backup manifest"):
        parse_manifest("B1", text)


def test_a_newer_format_is_refused() -> None:
    with pytest.raises(TooNew, match="manifest format 99"):
        parse_manifest("B1", b'{"format": 99}')


@pytest.mark.parametrize(("backup", "code", "refused"), [(2, 2, False), (1, 2, False), (3, 2, True)])
def test_a_newer_schema_is_refused(backup: int, code: int, refused: bool) -> None:
    if refused:
        with pytest.raises(TooNew, match=f"taken at schema {backup}.*knows schema {code}: upgrade Zattera"):
            check_restorable(manifest(backup), code)
    else:
        check_restorable(manifest(backup), code)


def test_restore_leaves_the_old_machines_behind_and_writes_envs_last() -> None:
    volume = pb.Volume(node_id="old-node", name="data")
    volume.lease.node_id = "old-node"
    state = BucketCopy(
        9,
        {
            "env.E1": b"e",
            "node.N1": b"n",
            "lease.scheduler": b"l",
            "assignment.N1.A1": b"a",
            "observed.N1.A1": b"o",
            "release.R1": b"r",
            "volume.V1": volume.SerializeToString(),
            "secret.S1": b"s",
        },
    )
    written = restorable(state)
    assert [k for k, _ in written] == ["release.R1", "secret.S1", "volume.V1", "env.E1"]
    restored = pb.Volume.FromString(dict(written)["volume.V1"])
    assert restored.node_id == "" and not restored.HasField("lease") and restored.name == "data"


@pytest.mark.parametrize(
    ("keys", "empty"),
    [({}, True), ({"node.N": b"", "lease.x": b"", "secretskey.cluster": b""}, True), ({"env.E": b""}, False)],
)
def test_a_cluster_is_empty_without_operator_records(keys: dict[str, bytes], empty: bool) -> None:
    assert is_empty(BucketCopy(1, keys)) is empty


FAST = {"opslimit": pwhash.argon2id.OPSLIMIT_MIN, "memlimit": pwhash.argon2id.MEMLIMIT_MIN}


def test_the_passphrase_opens_the_seal_and_a_wrong_one_says_so() -> None:
    sealed = recovery.seal(b"keyring", "a long recovery phrase", **FAST)
    assert b"keyring" not in sealed
    assert recovery.unseal(sealed, "a long recovery phrase") == b"keyring"
    with pytest.raises(recovery.WrongPassphrase, match="does not open this backup's secrets key"):
        recovery.unseal(sealed, "another long phrase!")


def test_a_short_passphrase_is_refused() -> None:
    with pytest.raises(recovery.WeakPassphrase, match="at least 12 characters"):
        recovery.seal(b"k", "short", **FAST)


def test_the_state_object_is_compressed_and_a_plain_one_from_an_older_backup_still_reads() -> None:
    plain = b'{"values": {"env.E": "' + b"x" * 10_000 + b'"}}'
    packed = _compressed(plain)
    assert len(packed) < len(plain) // 20
    new = Manifest(
        "B1", 1.0, "0.2.0", 3, 7, "C", (Entry(STATE, STATE, sha256(packed), len(packed), {"encoding": ZSTD}),)
    )
    old = Manifest("B0", 1.0, "0.2.0", 3, 7, "C", (Entry(STATE, STATE, sha256(plain), len(plain)),))
    assert decoded(new, STATE, packed) == plain
    assert decoded(old, STATE, plain) == plain
    with pytest.raises(Corrupt, match="backup B1: the state object does not decompress"):
        decoded(new, STATE, plain)
