"""Images of the docker runtime: a registry image loaded into the daemon as a derived image (``FROM`` the
node's base image, or ``scratch`` for an image carrying its own root filesystem, its layers ``ADD``ed in
order, tagged ``zattera-local/<digest>``), and the pure pieces that build it. See docs/containers.md."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.agent.images import PreparedImage

LABEL_MANAGED = "dev.zattera.managed"
LABEL_ROOTFS = "dev.zattera.rootfs"
"""On a registry image config: ``full`` = its layers are a whole root filesystem (no base image under it)."""


LOCAL_REPO = "zattera-local"


DOCKER_SCHEME = "docker://"


@dataclass(frozen=True)
class ContainerImage(PreparedImage):
    """A prepared image loaded into the daemon: ``workdir`` is a path inside the container."""

    tag: str = ""
    user: str = ""
    named_user: bool = False
    """The container's user gets a name in an ``/etc/passwd`` mounted over the image's (add-ons: ``initdb``)."""


def container_image(ref: str, tag: str, run: Mapping[str, Any]) -> ContainerImage:
    """What an image config's ``config`` section says about running it."""
    return ContainerImage(
        ref,
        Path(str(run.get("WorkingDir") or "/")),
        entrypoint=[str(x) for x in run.get("Entrypoint") or []],
        cmd=[str(x) for x in run.get("Cmd") or []],
        env=dict(item.split("=", 1) for item in run.get("Env") or [] if "=" in item),
        tag=tag,
        user=str(run.get("User") or ""),
    )


def first_line(message: object) -> str:
    return str(message).strip().splitlines()[0] if str(message).strip() else "failed"


def derived_tag(digest: str) -> str:
    return f"{LOCAL_REPO}:{digest.removeprefix('sha256:')[:32]}"


def build_context(base: str, layers: Sequence[bytes], labels: Mapping[str, str]) -> bytes:
    """A gzip'd build context: a Dockerfile ``FROM base`` that ``ADD``s each layer (Docker unpacks a local tar
    it ``ADD``s), and the layers themselves."""
    lines = [f"FROM {base}"]
    lines += [f"LABEL {json.dumps(k)}={json.dumps(v)}" for k, v in labels.items()]
    files = {"Dockerfile": b""}
    for index, layer in enumerate(layers):
        name = f"layer{index}.tar.gz"
        files[name] = layer
        lines.append(f"ADD {name} /")
    files["Dockerfile"] = ("\n".join(lines) + "\n").encode()
    return _tar(files, gzip=True)


def managed(config: bytes) -> bytes:
    """The image config labelled as ours, so the launcher's ``prune_images`` (``docker_runtime.py``) may
    remove it."""
    doc = json.loads(config)
    run = doc.get("config") or {}
    run["Labels"] = {**(run.get("Labels") or {}), LABEL_MANAGED: "true"}
    doc["config"] = run
    return json.dumps(doc).encode()


def docker_archive(tag: str, config: bytes, layers: Sequence[bytes]) -> bytes:
    """A ``docker load`` tarball of one image (its layers may stay gzip'd: the daemon decompresses)."""
    files = {"config.json": config}
    for index, layer in enumerate(layers):
        files[f"{index}/layer.tar"] = layer
    manifest = [{"Config": "config.json", "RepoTags": [tag], "Layers": [f"{i}/layer.tar" for i in range(len(layers))]}]
    files["manifest.json"] = json.dumps(manifest).encode()
    return _tar(files, gzip=False)


def _tar(files: Mapping[str, bytes], *, gzip: bool) -> bytes:
    """A tarball of ``files`` (name → content, mode 0644), gzip'd fast when ``gzip``."""
    buffer = io.BytesIO()
    if gzip:
        with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
            _add(tar, files)
    else:
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            _add(tar, files)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, files: Mapping[str, bytes]) -> None:
    for name, data in files.items():
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
