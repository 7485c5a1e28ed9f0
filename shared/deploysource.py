"""What ``zattera deploy DIR`` checks about DIR before uploading it (and the console, any other writer alike).

* **The build would plan**: the checks the builder makes (:func:`shared.buildplan.check_source`: a malformed
  ``zattera.toml``, ``package.json``…, a build step that is not a string, no start command), with the same
  messages, so a broken source costs no upload, no release number and no failed deploy.
* **The folder is the env's app**: DIR's ``zattera.toml`` names a project and an app; deploying it into an env
  of another app replaces that app's release with this source — refused unless forced (:func:`mismatch`).
* **Which env**: when the file names project, app and exactly one env, that env is the target and ``--env``
  may be left out (:func:`default_env`).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from shared.buildplan import BuildPlan, PlanError, check_source, read_source
from shared.errors import ZatteraError

MANIFEST = "zattera.toml"


class SourceRefused(ZatteraError, ValueError):
    """A source directory a deploy must not upload as it is (the message says why and what to do)."""


@dataclass(frozen=True)
class Manifest:
    """What a source's ``zattera.toml`` says about where it belongs ("" / () when it does not say)."""

    directory: Path
    project: str = ""
    app: str = ""
    envs: tuple[str, ...] = ()
    found: bool = False

    @property
    def app_path(self) -> str:
        """``project/app`` when the file names both, else ""."""
        return f"{self.project}/{self.app}" if self.project and self.app else ""

    @property
    def where(self) -> str:
        return str(self.directory / MANIFEST)


def inspect_source(directory: Path, *, docker: bool | None = None) -> tuple[Manifest, BuildPlan]:
    """DIR's manifest and build plan, checked as a build would check them; :class:`SourceRefused` with the
    build's own message (``zattera.toml: …``) otherwise."""
    if not directory.is_dir():
        raise SourceRefused(f"DIR {str(directory)!r}: not a directory")
    files = read_source(directory)
    try:
        plan = check_source(files, docker=docker)
    except PlanError as exc:
        raise SourceRefused(f"{directory}: {exc} (a build of it would fail with this; nothing was uploaded)") from None
    return manifest_of(directory, files.get(MANIFEST)), plan


def manifest_of(directory: Path, text: str | None) -> Manifest:
    """The names a zattera.toml gives (the text was parsed by :func:`check_source` already)."""
    if text is None:
        return Manifest(directory)
    raw = tomllib.loads(text)
    envs = raw.get("env")
    return Manifest(
        directory,
        project=raw["project"] if isinstance(raw.get("project"), str) else "",
        app=raw["app"] if isinstance(raw.get("app"), str) else "",
        envs=tuple(sorted(envs)) if isinstance(envs, dict) else (),
        found=True,
    )


def default_env(manifest: Manifest) -> str:
    """The ``--env`` of a deploy that gives none: ``project/app/env`` when the file names exactly one env;
    :class:`SourceRefused` saying why the env must be given otherwise (the message follows "--env: ")."""
    if not manifest.found:
        raise SourceRefused(f"not given, and {manifest.directory} has no {MANIFEST} naming the app and its env")
    if not manifest.app_path:
        raise SourceRefused(f"not given, and {manifest.where} does not name both project and app")
    if len(manifest.envs) != 1:
        named = ", ".join(manifest.envs) or "none"
        raise SourceRefused(
            f"not given, and {manifest.where} names {len(manifest.envs)} envs ({named}): say which, "
            f"e.g. --env {manifest.app_path}/{manifest.envs[0] if manifest.envs else 'production'}"
        )
    return f"{manifest.app_path}/{manifest.envs[0]}"


def mismatch(manifest: Manifest, target: str, given: str) -> str:
    """Why deploying this source into ``target`` (``project/app/env``, what ``--env given`` names) replaces
    another app ("" when the file names no app, or the target's). The refusal says what to do instead."""
    if not manifest.app_path:
        return ""
    project, app, _ = target.split("/", 2)
    if (project, app) == (manifest.project, manifest.app):
        return ""
    own = f"{manifest.app_path}/{manifest.envs[0]}" if manifest.envs else f"{manifest.app_path}/<env>"
    return (
        f"{manifest.where} names {manifest.app_path}, not {project}/{app} (--env {given}): deploying it would "
        f"replace {target}'s release with {manifest.app_path}'s source. Deploy it to its own env "
        f"(--env {own}), or add --force to replace {target} with it anyway"
    )
