"""Container image archives → what the cluster registry stores (an OCI image config and gzip'd layers).

Two archive formats are read, both as a tar (optionally gzip'd) in memory:

* ``docker save`` output: ``manifest.json`` = ``[{"Config": "<file>", "Layers": ["<dir>/layer.tar", ...]}]``;
* an OCI image layout: ``oci-layout``, ``index.json`` → a manifest (or an index of them: the one for
  ``platform``, else the first) → ``blobs/sha256/<hex>``.

Layers are gzip'd when they are not already; the config's ``diff_ids`` (digests of the uncompressed layers)
stay valid. The config gets the label ``dev.zattera.rootfs=full``: the image brings its whole root
filesystem, so the docker runtime runs it ``FROM scratch`` rather than on the node's base image.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from dataclasses import dataclass
from typing import Any

ROOTFS_LABEL = "dev.zattera.rootfs"
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_ARCHIVE_BYTES = 2 * 1024 * 1024 * 1024


class ImageArchiveError(Exception):
    """The archive is neither a ``docker save`` tarball nor an OCI layout, or is inconsistent."""


@dataclass(frozen=True)
class ArchiveImage:
    config: bytes
    layers: list[bytes]
    platform: str


def _members(data: bytes) -> dict[str, bytes]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            files: dict[str, bytes] = {}
            total = 0
            for member in tar:
                if not member.isfile():
                    continue
                total += member.size
                if total > _MAX_ARCHIVE_BYTES:
                    raise ImageArchiveError(f"archive exceeds {_MAX_ARCHIVE_BYTES} bytes")
                extracted = tar.extractfile(member)
                if extracted is not None:
                    files[member.name.removeprefix("./")] = extracted.read()
            return files
    except (tarfile.TarError, EOFError, OSError):
        raise ImageArchiveError("not a tar archive (a `docker save` tarball or an OCI layout)") from None


def _json(files: dict[str, bytes], name: str) -> Any:
    if name not in files:
        raise ImageArchiveError(f"archive has no {name}")
    try:
        return json.loads(files[name])
    except ValueError as exc:
        raise ImageArchiveError(f"{name}: {exc}") from exc


def _blob(files: dict[str, bytes], digest: str) -> bytes:
    algorithm, _, hexdigest = str(digest).partition(":")
    name = f"blobs/{algorithm}/{hexdigest}"
    if name not in files:
        raise ImageArchiveError(f"archive has no blob {digest}")
    return files[name]


def _gzipped(layer: bytes) -> bytes:
    return layer if layer.startswith(_GZIP_MAGIC) else gzip.compress(layer, mtime=0)


def _marked(config: bytes) -> tuple[bytes, str]:
    """The config labelled as a full root filesystem, and its platform (``os/arch``)."""
    try:
        doc = json.loads(config)
        run = doc.setdefault("config", {}) or {}
        doc["config"] = run
        labels = run.get("Labels") or {}
        labels[ROOTFS_LABEL] = "full"
        run["Labels"] = labels
    except (ValueError, AttributeError, TypeError) as exc:
        raise ImageArchiveError(f"bad image config: {exc}") from exc
    platform = f"{doc.get('os') or 'linux'}/{doc.get('architecture') or 'amd64'}"
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), platform


def _oci(files: dict[str, bytes], platform: str) -> tuple[bytes, list[bytes]]:
    index = _json(files, "index.json")
    manifests = index.get("manifests") or []
    if not manifests:
        raise ImageArchiveError("index.json lists no manifest")
    manifest = json.loads(_blob(files, manifests[0]["digest"]))
    if "manifests" in manifest:  # an index inside: pick the platform
        children = manifest["manifests"]
        wanted = [
            m
            for m in children
            if f"{(m.get('platform') or {}).get('os')}/{(m.get('platform') or {}).get('architecture')}" == platform
        ]
        manifest = json.loads(_blob(files, (wanted or children)[0]["digest"]))
    config = _blob(files, manifest["config"]["digest"])
    return config, [_blob(files, layer["digest"]) for layer in manifest.get("layers") or []]


def _docker_save(files: dict[str, bytes]) -> tuple[bytes, list[bytes]]:
    entries = _json(files, "manifest.json")
    if not isinstance(entries, list) or not entries:
        raise ImageArchiveError("manifest.json lists no image")
    entry = entries[0]
    name = str(entry.get("Config", ""))
    if name not in files:
        raise ImageArchiveError(f"archive has no {name or 'config'}")
    layers = []
    for layer in entry.get("Layers") or []:
        if layer not in files:
            raise ImageArchiveError(f"archive has no layer {layer}")
        layers.append(files[layer])
    return files[name], layers


def read_image_archive(data: bytes, *, platform: str = "linux/amd64") -> ArchiveImage:
    """The image in a ``docker save`` tarball or an OCI layout tarball (see the module docstring)."""
    files = _members(data)
    try:
        if "index.json" in files and "oci-layout" in files:
            config, layers = _oci(files, platform)
        else:
            config, layers = _docker_save(files)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ImageArchiveError(f"inconsistent archive: {exc}") from exc
    marked, image_platform = _marked(config)
    return ArchiveImage(marked, [_gzipped(layer) for layer in layers], image_platform)
