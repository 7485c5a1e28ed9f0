"""The object-store registry and its sweeper on real NATS."""

from __future__ import annotations

import asyncio
import json

import pytest
from zattera.v1 import types_pb2 as pb

from services.builds.registry import RegistrySweeper
from shared.clock import FakeClock
from shared.connection import Connection
from shared.registry import (
    OCI_INDEX,
    OCI_MANIFEST,
    BlobStore,
    BlobUnknown,
    ManifestUnknown,
    PlatformImage,
    PlatformUnknown,
    RegistryError,
    digest_of,
    fetch_image,
    image_manifest,
    index_platforms,
    lookup_tag,
    push_image,
)
from shared.state.feed import StateView
from shared.subjects import IMAGES_STORE
from shared.txn import Writer
from tests.waiting import eventually

GRACE = 900.0


@pytest.fixture
def blobs(conn: Connection, clock: FakeClock) -> BlobStore:
    return BlobStore(conn, IMAGES_STORE, clock=clock)


@pytest.fixture
def sweeper(conn: Connection, view: StateView, clock: FakeClock) -> RegistrySweeper:
    return RegistrySweeper(conn, view, clock, grace=GRACE)


async def tagged(view: StateView, image: pb.Image) -> None:
    await eventually(lambda: view.get("image", image.meta.id) is not None, 5, "tag in the view")


async def test_push_then_fetch_by_tag_and_by_digest_round_trips(
    conn: Connection, view: StateView, clock: FakeClock
) -> None:
    image = await push_image(
        conn, repo="proj/app", tag="V1", images=[PlatformImage("linux/amd64", b"cfg", [b"layer"])], clock=clock
    )
    assert (image.repo, image.tag, image.media_type) == ("proj/app", "v1", OCI_MANIFEST)
    assert image.digest == digest_of(image_manifest(b"cfg", [b"layer"]))
    by_tag = await fetch_image(conn, "proj/app:v1")
    by_digest = await fetch_image(conn, f"ctrl:5000/proj/app@{image.digest}")
    assert by_tag == by_digest
    assert (by_tag.config, by_tag.layers) == (b"cfg", [b"layer"])
    assert await lookup_tag(conn, "PROJ/app", "v1") == image


async def test_fetch_of_an_unknown_tag_is_manifest_unknown(conn: Connection) -> None:
    with pytest.raises(ManifestUnknown):
        await fetch_image(conn, "proj/app:nope")


async def test_manifest_referencing_a_never_uploaded_blob_is_blob_unknown(conn: Connection, blobs: BlobStore) -> None:
    manifest = await blobs.put(image_manifest(b"never-config", [b"never-layer"]))
    with pytest.raises(BlobUnknown, match="blob unknown"):
        await fetch_image(conn, f"proj/app@{manifest}")


async def test_multi_arch_index_resolves_platforms_and_untag_frees_all_eight_objects(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, blobs: BlobStore, sweeper: RegistrySweeper
) -> None:
    images = [
        PlatformImage("linux/amd64", b"cfg-amd", [b"base", b"lay-amd"]),
        PlatformImage("linux/arm64", b"cfg-arm", [b"base", b"lay-arm"]),
    ]
    image = await push_image(conn, repo="proj/app", tag="latest", images=images, clock=clock)
    await tagged(view, image)
    assert image.media_type == OCI_INDEX and list(image.platforms) == ["linux/amd64", "linux/arm64"]
    assert index_platforms(await blobs.get(image.digest)) == ["linux/amd64", "linux/arm64"]
    arm = await fetch_image(conn, "proj/app:latest", platform="linux/arm64")
    assert (arm.digest, arm.config, arm.layers) == (image.digest, b"cfg-arm", [b"base", b"lay-arm"])
    assert (await fetch_image(conn, "proj/app:latest", platform="linux/amd64")).config == b"cfg-amd"
    with pytest.raises(PlatformUnknown):
        await fetch_image(conn, "proj/app:latest", platform="windows/arm64")
    assert len(image.blob_digests) == 8  # 5 blobs, 2 child manifests, the index

    await clock.advance(GRACE)
    report = await sweeper.untag_and_sweep(writer, "proj/app", "latest")
    assert sorted(report.deleted) == sorted(image.blob_digests)
    assert [await blobs.has(d) for d in image.blob_digests] == [False] * 8


async def test_untag_reclaims_what_the_image_solely_kept_alive_and_shared_layers_survive(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, blobs: BlobStore, sweeper: RegistrySweeper
) -> None:
    a = await push_image(
        conn, repo="proj/app", tag="a", images=[PlatformImage("linux/amd64", b"cfgA", [b"shared"])], clock=clock
    )
    b = await push_image(
        conn, repo="proj/app", tag="b", images=[PlatformImage("linux/amd64", b"cfgB", [b"shared"])], clock=clock
    )
    await tagged(view, a)
    await tagged(view, b)
    await clock.advance(GRACE)

    first = await sweeper.untag_and_sweep(writer, "proj/app", "a")
    assert sorted(first.deleted) == sorted([digest_of(b"cfgA"), a.digest])
    assert await blobs.has(digest_of(b"shared")) and await blobs.has(digest_of(b"cfgB"))

    second = await sweeper.untag_and_sweep(writer, "proj/app", "b")
    assert sorted(second.deleted) == sorted([digest_of(b"cfgB"), digest_of(b"shared"), b.digest])


async def test_untag_of_an_unknown_tag_is_a_no_op(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, sweeper: RegistrySweeper
) -> None:
    image = await push_image(
        conn, repo="proj/app", tag="v1", images=[PlatformImage("linux/amd64", b"c", [b"l"])], clock=clock
    )
    await tagged(view, image)
    await clock.advance(GRACE)
    assert await sweeper.untag(writer, "proj/other", "v9") is False
    assert (await sweeper.collect()).deleted == ()


async def test_orphan_blob_is_reclaimed_only_after_the_grace_period(
    blobs: BlobStore, clock: FakeClock, sweeper: RegistrySweeper
) -> None:
    orphan = await blobs.put(b"interrupted push")
    await clock.advance(GRACE - 1)
    assert (await sweeper.collect()).deleted == ()
    await clock.advance(1)
    assert (await sweeper.collect()).deleted == (orphan,)


async def test_blob_store_round_trips_dedups_and_rejects_a_wrong_digest(blobs: BlobStore, clock: FakeClock) -> None:
    digest = await blobs.put(b"payload")
    assert digest == digest_of(b"payload") and await blobs.get(digest) == b"payload"
    first = await blobs.stat(digest)
    await clock.advance(60)
    assert await blobs.put(b"payload") == digest  # present: touched, not uploaded again
    again = await blobs.stat(digest)
    assert first is not None and again is not None
    assert (again.nuid, again.size, again.written_at) == (first.nuid, 7, first.written_at + 60)
    assert not await blobs.has(digest_of(b"absent"))
    with pytest.raises(BlobUnknown):
        await blobs.get(digest_of(b"absent"))
    with pytest.raises(RegistryError, match="mismatch"):
        await blobs.put(b"other", digest=digest_of(b"expected"))
    assert not await blobs.has(digest_of(b"other")) and not await blobs.has(digest_of(b"expected"))


async def test_touch_and_delete_race_on_one_revision_so_exactly_one_wins(blobs: BlobStore) -> None:
    digest = await blobs.put(b"layer")
    seen_by_sweeper = await blobs.stat(digest)
    seen_by_pusher = await blobs.stat(digest)
    assert seen_by_sweeper is not None and seen_by_pusher is not None
    assert await blobs.touch(seen_by_pusher)
    assert not await blobs.delete_if_unchanged(seen_by_sweeper)  # the push's touch won
    assert await blobs.get(digest) == b"layer"

    current = await blobs.stat(digest)
    assert current is not None and await blobs.delete_if_unchanged(current)
    assert not await blobs.touch(current)  # the delete won: the pusher must upload again
    assert await blobs.put(b"layer") == digest and await blobs.get(digest) == b"layer"


async def test_concurrent_pushes_reusing_old_blobs_during_sweeps_never_lose_a_tagged_blob(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock, sweeper: RegistrySweeper
) -> None:
    for round_ in range(6):
        layer = f"layer {round_}".encode()
        old = await push_image(
            conn,
            repo="proj/app",
            tag=f"old{round_}",
            images=[PlatformImage("linux/amd64", b"c0", [layer])],
            clock=clock,
        )
        await tagged(view, old)
        await clock.advance(GRACE)
        await sweeper.untag(writer, "proj/app", f"old{round_}")  # its blobs are now old and unreferenced

        async def push(round_: int = round_, layer: bytes = layer) -> pb.Image:
            await asyncio.sleep(0.001 * round_)  # vary the interleaving with the sweep
            return await push_image(
                conn,
                repo="proj/app",
                tag=f"new{round_}",
                images=[PlatformImage("linux/amd64", b"c0", [layer])],
                clock=clock,
            )

        new, _ = await asyncio.gather(push(), sweeper.collect())
        await tagged(view, new)
        await sweeper.collect()
        fetched = await fetch_image(conn, f"proj/app:new{round_}")
        assert fetched.layers == [layer] and fetched.config == b"c0"
        assert json.loads(await BlobStore(conn).get(new.digest))["layers"][0]["digest"] == digest_of(layer)
