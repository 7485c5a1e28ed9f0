"""Retention (lease ``retention``): prune old releases and their images, stale source tarballs, then
sweep the registry. Runs at the start of a term and then an hour after each sweep finished.

Per environment it keeps the 10 newest releases, the active one, the previous one (highest version
below the active) and the release and previous release of every non-terminal deployment. Source tarballs
written more than 24 h ago are deleted.

* Images of every kind of build are reclaimed: a release's images are found by its build —
  ``source.build_id`` or the build of a deployment that created it (CLI uploads) — as the tag
  ``lower(<project>/<app>):lower(<build id>)``, and by its pinned digest. An image still used by a
  remaining release (same tag, or same digest as its ref: deploy-by-build releases share images) is
  kept.
* Untagging and deleting the release are one atomic batch. One failed prune does not abort the others
  nor the tarball cleanup.
* A tarball needed by a QUEUED or RUNNING build is never deleted, and re-uploading the same
  source refreshes its written-at time (shared/registry.py ``BlobStore.put``).
* A deleted environment (``zattera envs|apps|projects delete``) loses every release no replica uses any
  more, with its images; once none is left, its finished deployments and builds go too. An env deletion
  wakes the loop, so this does not wait for the next hourly sweep.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from services.builds.registry import RegistrySweeper
from services.builds.settings import DEFAULTS
from shared import keys as K
from shared.decision import Decision
from shared.deployments import is_terminal
from shared.loop import FULL, LeaderLoop, LoopDeps, Scope
from shared.registry import BlobInfo, BlobStore, parse_ref, repository
from shared.state.changes import Change
from shared.streams import DAY
from shared.subjects import SOURCES_STORE

log = logging.getLogger(__name__)

KEEP_RELEASES = 10
SOURCE_MAX_AGE = DAY

LIVE_BUILD_STATUSES = frozenset({pb.BUILD_STATUS_QUEUED, pb.BUILD_STATUS_RUNNING})


@dataclass(frozen=True, slots=True)
class Prune:
    release_id: str
    environment_id: str
    version: int
    image_ids: tuple[str, ...]
    """``image.<id>`` keys untagged in the same batch as the release delete."""


def kept_release_ids(
    env: pb.Environment, releases: Sequence[pb.Release], deployments: Sequence[pb.Deployment], keep: int
) -> set[str]:
    """``releases`` newest first."""
    kept = {r.meta.id for r in releases[:keep]}
    kept.add(env.active_release_id)
    active = next((r for r in releases if r.meta.id == env.active_release_id), None)
    if active is not None:
        previous = next((r for r in releases if r.version < active.version), None)
        if previous is not None:
            kept.add(previous.meta.id)
    for d in deployments:
        if not is_terminal(d.phase):
            kept.update((d.release_id, d.previous_release_id))
    kept.discard("")
    return kept


def release_build_ids(release: pb.Release, deployments_by_release: Mapping[str, Sequence[pb.Deployment]]) -> set[str]:
    ids = {d.build_id for d in deployments_by_release.get(release.meta.id, ()) if d.build_id}
    if release.source.build_id:
        ids.add(release.source.build_id)
    return ids


@dataclass(frozen=True, slots=True)
class _Uses:
    """(repo, tag) and (repo, digest) pairs releases use."""

    tags: frozenset[tuple[str, str]]
    digests: frozenset[tuple[str, str]]


def _uses(releases: Sequence[pb.Release], deployments_by_release: Mapping[str, Sequence[pb.Deployment]]) -> _Uses:
    tags: set[tuple[str, str]] = set()
    digests: set[tuple[str, str]] = set()
    for release in releases:
        repo = repository(release.project_id, release.app_id)
        tags.update((repo, b.lower()) for b in release_build_ids(release, deployments_by_release))
        if release.image_ref:
            ref = parse_ref(release.image_ref)
            if ref.digest:
                digests.add((ref.repo, ref.digest))
            if ref.tag:
                tags.add((ref.repo, ref.tag))
    return _Uses(frozenset(tags), frozenset(digests))


def _uses_image(uses: _Uses, image: pb.Image) -> bool:
    if (image.repo, image.tag) in uses.tags or (image.repo, image.digest) in uses.digests:
        return True
    return any((image.repo, d) in uses.digests for d in image.manifest_digests)


def evaluate(
    *,
    envs: Mapping[str, pb.Environment],
    releases: Sequence[pb.Release],
    deployments: Sequence[pb.Deployment],
    images: Sequence[pb.Image],
    keep: int = KEEP_RELEASES,
    in_use: frozenset[str] = frozenset(),
) -> list[Prune]:
    """Which releases to delete (newest first per env) and which tags go with each. ``in_use``: release
    ids some assignment still names (a deleted env's releases wait until its replicas are reaped)."""
    releases_by_env: dict[str, list[pb.Release]] = defaultdict(list)
    for r in releases:
        releases_by_env[r.environment_id].append(r)
    deployments_by_env: dict[str, list[pb.Deployment]] = defaultdict(list)
    deployments_by_release: dict[str, list[pb.Deployment]] = defaultdict(list)
    for d in deployments:
        deployments_by_env[d.environment_id].append(d)
        deployments_by_release[d.release_id].append(d)

    pruned: list[pb.Release] = []
    for env_id in sorted(releases_by_env):
        env = envs.get(env_id)
        rels = sorted(releases_by_env[env_id], key=lambda r: (r.version, r.meta.id), reverse=True)
        if env is None:
            kept = {r.meta.id for r in rels if r.meta.id in in_use}
        else:
            kept = kept_release_ids(env, rels, deployments_by_env.get(env_id, []), keep)
        pruned.extend(r for r in rels if r.meta.id not in kept)

    pruned_ids = {r.meta.id for r in pruned}
    remaining_uses = _uses([r for r in releases if r.meta.id not in pruned_ids], deployments_by_release)
    by_tag = {(i.repo, i.tag): i for i in images}
    by_digest: dict[tuple[str, str], list[pb.Image]] = defaultdict(list)
    for image in images:
        for digest in (image.digest, *image.manifest_digests):
            by_digest[(image.repo, digest)].append(image)
    taken: set[str] = set()
    prunes: list[Prune] = []
    for release in pruned:
        own = _uses([release], deployments_by_release)
        found = [by_tag[t] for t in sorted(own.tags) if t in by_tag]
        found += [i for d in sorted(own.digests) for i in by_digest.get(d, [])]
        image_ids = []
        for image in found:
            if image.meta.id in taken or _uses_image(remaining_uses, image):
                continue
            taken.add(image.meta.id)
            image_ids.append(image.meta.id)
        prunes.append(Prune(release.meta.id, release.environment_id, release.version, tuple(image_ids)))
    return prunes


def deleted_env_leftovers(
    envs: Mapping[str, pb.Environment],
    releases: Sequence[pb.Release],
    deployments: Sequence[pb.Deployment],
    builds: Sequence[pb.Build],
) -> list[str]:
    """Keys of the finished deployments and builds of deleted envs that have no release left (their
    images are gone with the releases; a deployment or build still under way waits until it ends)."""
    with_releases = {r.environment_id for r in releases}

    def gone(env_id: str) -> bool:
        return bool(env_id) and env_id not in envs and env_id not in with_releases

    keys = [K.deployment(d.meta.id) for d in deployments if gone(d.environment_id) and is_terminal(d.phase)]
    keys += [K.build(b.meta.id) for b in builds if gone(b.environment_id) and b.status not in LIVE_BUILD_STATUSES]
    return keys


def stale_sources(
    blobs: Sequence[BlobInfo], builds: Sequence[pb.Build], *, now: float, max_age: float = SOURCE_MAX_AGE
) -> list[BlobInfo]:
    """Tarballs written strictly more than ``max_age`` ago that no QUEUED or RUNNING build needs."""
    needed = {b.tarball_digest for b in builds if b.status in LIVE_BUILD_STATUSES and b.tarball_digest}
    return [blob for blob in blobs if blob.written_at < now - max_age and blob.digest not in needed]


class Retention(LeaderLoop):
    """Sweeps at once, then ``interval`` after each sweep finished (its tick), or as soon as an env is deleted."""

    name = "retention"
    kinds = frozenset({K.ENV, K.ASSIGNMENT})

    def __init__(
        self,
        deps: LoopDeps,
        *,
        sweeper: RegistrySweeper | None = None,
        interval: float = DEFAULTS.retention_interval,
        keep: int = KEEP_RELEASES,
        source_max_age: float = SOURCE_MAX_AGE,
    ) -> None:
        super().__init__(deps, tick=interval)
        self.sweeper = sweeper
        self.keep = keep
        self.source_max_age = source_max_age
        self._sources = BlobStore(self.conn, SOURCES_STORE, clock=self.clock)
        self.sweeps = 0

    def scope_of(self, changes: set[Change]) -> Scope:
        """A deleted env to clean up wakes a full pass at once (an env deleted, or the last replica of a
        deleted env reaped); any other change waits for the interval."""
        return FULL if self._cleanup_due(changes) else frozenset()

    def _cleanup_due(self, changes: set[Change]) -> bool:
        for kind, ident in changes:
            if kind == K.ENV and self.view.env(ident) is None:
                return True
            if kind == K.ASSIGNMENT and self.view.assignment(ident) is None and self._prunable_deleted_env_release():
                return True
        return False

    def _prunable_deleted_env_release(self) -> bool:
        """A release of a deleted env that no assignment names any more (its last replica was reaped)."""
        return any(
            self.view.env(r.environment_id) is None and not self.view.assignment_ids_by_release(r.meta.id)
            for r in self.view.releases()
        )

    async def run_pass(self) -> None:
        await self.prune_releases()
        await self.delete_deleted_env_leftovers()
        await self.delete_stale_sources()
        if self.sweeper is not None:
            await self.sweeper.collect()
        self.sweeps += 1

    async def prune_releases(self) -> list[Prune]:
        prunes = evaluate(
            envs={e.meta.id: e for e in self.view.envs()},
            releases=self.view.releases(),
            deployments=self.view.deployments(),
            images=self.view.images(),
            keep=self.keep,
            in_use=frozenset(a.release_id for a in self.view.assignments()),
        )
        landed = await self.commit_decisions(
            [
                Decision(
                    f"prune release {prune.release_id}",
                    deletes=[*(K.image(ident) for ident in prune.image_ids), K.release(prune.release_id)],
                )
                for prune in prunes
            ]
        )
        done = []
        for prune, ok in zip(prunes, landed, strict=True):
            if ok:
                done.append(prune)
                log.info(
                    "release pruned: env %s release %s version %d (%d images untagged)",
                    prune.environment_id,
                    prune.release_id,
                    prune.version,
                    len(prune.image_ids),
                )
        return done

    async def delete_deleted_env_leftovers(self) -> list[str]:
        keys = deleted_env_leftovers(
            {e.meta.id: e for e in self.view.envs()}, self.view.releases(), self.view.deployments(), self.view.builds()
        )
        landed = await self.commit_decisions([Decision("deleted env leftover", deletes=[k]) for k in keys])
        done = [k for k, ok in zip(keys, landed, strict=True) if ok]
        if done:
            log.info("deleted %d finished deployments and builds of deleted environments", len(done))
        return done

    async def delete_stale_sources(self) -> list[str]:
        candidates = stale_sources(
            await self._sources.list(), self.view.builds(), now=self.clock.now(), max_age=self.source_max_age
        )
        deleted = []
        for candidate in candidates:
            fresh = await self._sources.stat(candidate.digest)
            if fresh is None or not stale_sources(
                [fresh], self.view.builds(), now=self.clock.now(), max_age=self.source_max_age
            ):
                continue
            if await self._sources.delete_if_unchanged(fresh):
                deleted.append(fresh.digest)
        if deleted:
            log.info("deleted %d stale source tarballs", len(deleted))
        return deleted
