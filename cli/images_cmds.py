"""``zattera images import``: a ``docker save`` tarball or an OCI layout tarball into the cluster registry.

The image keeps its own root filesystem (the docker runtime runs it as it is, docs/containers.md); it is
tagged in the app's repository and printed as a digest ref ``zattera deploy --image`` takes.
"""

from __future__ import annotations

import json as jsonlib
from pathlib import Path

import typer

from cli import render
from cli.client import control, err, fail, run
from cli.options import JSON
from shared.imagearchive import ImageArchiveError, read_image_archive
from shared.registry import PlatformImage, RegistryError, push_image, repository

images_app = typer.Typer(no_args_is_help=True, help="Images of the cluster registry.")


@images_app.command("import")
def images_import(
    archive: Path = typer.Argument(..., help="a `docker save` tarball or an OCI image layout tarball (- = stdin)"),
    app_ref: str = typer.Option(..., "--app", help="project/app whose repository receives the image"),
    tag: str = typer.Option("latest", "--tag", help="tag in the app's repository"),
    json: bool = JSON,
) -> None:
    """Import a container image into the cluster registry; prints the ref to deploy it with --image."""
    from shared.actions.names import find_app, find_project

    project_name, _, app_name = app_ref.partition("/")
    if not project_name or not app_name or "/" in app_name:
        raise fail(f"--app: expected project/app, got {app_ref!r}")
    if not tag or len(tag) > 128 or not all(c.isalnum() or c in "._-" for c in tag):
        raise fail(f"--tag: {tag!r} is not a valid tag (letters, digits, '.', '_', '-'; at most 128)")
    try:
        data = typer.get_binary_stream("stdin").read() if str(archive) == "-" else archive.read_bytes()
    except OSError as exc:
        raise fail(f"archive: cannot read {archive}: {exc.strerror}") from None
    try:
        image = read_image_archive(data)
    except ImageArchiveError as exc:
        raise fail(f"archive: {exc}") from None

    async def go() -> None:
        async with control() as c:
            project = find_project(c.view, project_name)
            app = find_app(c.view, project.meta.id, app_name) if project else None
            if project is None or app is None:
                raise fail(f"--app: no app {app_ref!r}")
            repo = repository(project.meta.id, app.meta.id)
            try:
                record = await push_image(
                    c.conn, repo=repo, tag=tag, images=[PlatformImage(image.platform, image.config, image.layers)]
                )
            except RegistryError as exc:
                raise fail(f"push: {exc}") from None
            ref = f"{record.repo}@{record.digest}"
            if render.json_mode() or json:
                print(
                    jsonlib.dumps({"ref": ref, "repo": record.repo, "tag": record.tag, "size_bytes": record.size_bytes})
                )
                return
            err.print(
                f"imported {len(image.layers)} layer(s), {record.size_bytes} bytes, as {record.repo}:{record.tag}"
            )
            print(ref)

    run(go)
