"""Stack detection: what a source build installs, builds and starts (the builder's plan, ``zattera build plan``).

:func:`detect` is pure: it reads a :data:`SourceFiles` snapshot (relative path → text of the few files that
matter, :func:`read_source`) and returns a :class:`BuildPlan`. First match wins:

1. ``Dockerfile`` → provider ``dockerfile``: a container build (``BUILD_TYPE_DOCKERFILE``), which this
   process builder does not do: the plan carries an error saying so. Not when ``zattera.toml`` gives a
   build, install or start command: that source is meant for this builder.
2. Python: ``requirements.txt``, or ``pyproject.toml`` (with ``uv.lock``, ``poetry.lock`` or neither: pip
   semantics). Dependencies go into ``.zattera/python`` with ``uv pip install --target``.
3. Node: ``package.json``; ``npm ci`` with ``package-lock.json``, yarn or pnpm with theirs, else ``npm
   install``; ``npm run build`` when the ``build`` script exists; started with the ``start`` script's own
   command (after ``prestart``'s), not through ``npm start``.
4. Static: ``index.html`` served by ``python3 -m http.server`` on ``$PORT``.
5. Only a ``Procfile``: packed as is, started with its ``web:`` line.

The start command: ``zattera.toml`` ``[run] command``, else the ``Procfile`` ``web:`` line, else inferred
(Django, FastAPI, Flask, a Node ``start`` script or entry file); a detected stack with none of those is an
error asking for one. ``zattera.toml`` ``[build] install`` and ``[build] command`` replace the install and
build steps (an empty string skips the step).
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from shared.errors import ZatteraError

SourceFiles = Mapping[str, str]
"""Relative POSIX path → text, for the files :func:`read_source` collects (presence matters too)."""

DEPENDENCY_DIR_PYTHON = ".zattera"
"""Python's dependency layer: ``python/`` (the ``--target`` tree), ``bin/`` (interpreter shims), and the
requirements file generated from a lockfile."""
PYTHON_TARGET = f"{DEPENDENCY_DIR_PYTHON}/python"
GENERATED_REQUIREMENTS = f"{DEPENDENCY_DIR_PYTHON}/requirements.txt"
DEPENDENCY_DIR_NODE = "node_modules"

_LOCKFILES = ("uv.lock", "poetry.lock", "package-lock.json", "npm-shrinkwrap.json", "yarn.lock", "pnpm-lock.yaml")
_TOP_LEVEL = (
    "zattera.toml",
    "Procfile",
    "Dockerfile",
    "requirements.txt",
    "pyproject.toml",
    ".python-version",
    "runtime.txt",
    "package.json",
    "index.html",
    "manage.py",
    *_LOCKFILES,
)
# Where Flask/FastAPI apps usually live, in the order they are tried.
_PYTHON_ENTRY_FILES = ("app.py", "main.py", "wsgi.py", "asgi.py", "server.py", "application.py", "app/__init__.py")
_NODE_ENTRY_FILES = ("server.js", "index.js", "app.js", "main.js")
_MAX_READ = 256 * 1024


_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON_PROGRAM = re.compile(r"^python(3(\.\d+)?)?$")


def starts_python(command: str) -> bool:
    """Whether a start command runs the Python interpreter found on ``PATH`` (``python3 app.py``, ``exec python
    -m app``, ``PORT=1 python3 …``): a source packed as is, started so, runs on the builder's interpreter."""
    try:
        words = shlex.split(command)
    except ValueError:
        return False
    for word in words:
        if word == "exec" or _ASSIGNMENT.match(word):
            continue
        return bool(_PYTHON_PROGRAM.match(word))
    return False


class PlanError(ZatteraError):
    """A file the detector reads is malformed (the message names it)."""


@dataclass(frozen=True)
class BuildPlan:
    """What the builder does with a source. Empty ``install``/``build`` = no such step."""

    provider: str
    """``python``, ``node``, ``static``, ``dockerfile``, ``procfile`` or ``none`` (packed as is)."""
    reason: str = ""
    """Which file chose the provider."""
    install: str = ""
    build: str = ""
    start: str = ""
    start_source: str = ""
    """Where ``start`` came from: ``zattera.toml [run] command``, ``Procfile web:``, ``inferred (Flask)``, ..."""
    python: str = ""
    """The interpreter the app asks for (``3.12`` or a ``requires-python`` specifier); empty = the node's."""
    dependency_files: tuple[str, ...] = ()
    """The files the install reads: their contents (and the platform) key the dependency layer cache."""
    dependency_dir: str = ""
    """What the install writes, packed as the dependency layer; the rest of the directory is the app layer."""
    generated: dict[str, str] = field(default_factory=dict)
    """Files the builder writes before installing (a requirements list derived from a lockfile)."""
    error: str = ""
    """Set when the source cannot be built this way; the build fails with it."""

    def lines(self) -> list[str]:
        """The plan as the first build log lines (and ``zattera build plan``'s output)."""
        start = f"{self.start}  ({self.start_source})" if self.start else "(none)"
        lines = [
            f"plan: provider {self.provider}" + (f" ({self.reason})" if self.reason else ""),
            f"plan: install  {self.install or '(none)'}",
            f"plan: build    {self.build or '(none)'}",
            f"plan: start    {start}",
        ]
        if self.python:
            lines.append(f"plan: python   {self.python}")
        if self.error:
            lines.append(f"plan: error    {self.error}")
        return lines

    def as_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["dependency_files"] = list(self.dependency_files)
        return doc


def read_source(directory: Path) -> dict[str, str]:
    """The files :func:`detect` looks at, read from ``directory`` (missing ones are absent)."""
    names = [*_TOP_LEVEL, *_PYTHON_ENTRY_FILES, "app/main.py"]
    names += sorted(p.relative_to(directory).as_posix() for p in directory.glob("*/wsgi.py"))
    files: dict[str, str] = {}
    for name in dict.fromkeys(names):
        path = directory / name
        if path.is_file():
            with open(path, "rb") as fh:
                files[name] = fh.read(_MAX_READ).decode(errors="replace")
    return files


def _toml(files: SourceFiles, name: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        return tomllib.loads(files[name])
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{name}: {exc}") from exc


def _table(doc: Mapping[str, Any], *path: str) -> dict[str, Any]:
    node: Any = doc
    for part in path:
        node = node.get(part) if isinstance(node, Mapping) else None
    return dict(node) if isinstance(node, Mapping) else {}


def procfile_web(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("web:"):
            return line[len("web:") :].strip()
    return ""


_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(lines: Iterable[str]) -> set[str]:
    """Distribution names in requirement specifiers (``flask>=3``, ``uvicorn[standard]``; options skipped)."""
    names = set()
    for line in lines:
        match = _NAME_RE.match(line.split("#", 1)[0])
        if match and not line.lstrip().startswith("-"):
            names.add(_normalized(match.group(1)))
    return names


def poetry_requirements(lock_text: str) -> str:
    """Pinned ``name==version`` lines for the main group of a ``poetry.lock`` (installed with ``--no-deps``:
    the lock already lists every transitive package)."""
    try:
        lock = tomllib.loads(lock_text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"poetry.lock: {exc}") from exc
    pins = []
    for package in lock.get("package") or []:
        groups = package.get("groups") or [package.get("category") or "main"]
        if "main" in groups and package.get("name") and package.get("version"):
            pins.append(f"{package['name']}=={package['version']}")
    return "".join(f"{pin}\n" for pin in sorted(pins))


def _python_request(files: SourceFiles, pyproject: Mapping[str, Any]) -> str:
    if ".python-version" in files:
        first = files[".python-version"].strip().splitlines()
        match = re.match(r"^(?:python-?)?(\d+\.\d+)", first[0].strip()) if first else None
        if match:
            return match.group(1)
    if "runtime.txt" in files:
        match = re.match(r"^python-(\d+\.\d+)", files["runtime.txt"].strip())
        if match:
            return match.group(1)
    requires = _table(pyproject, "project").get("requires-python")
    return str(requires).strip() if requires else ""


def _python(files: SourceFiles) -> BuildPlan:
    pyproject = _toml(files, "pyproject.toml")
    project = _table(pyproject, "project")
    poetry_deps = _table(pyproject, "tool", "poetry", "dependencies")
    target = f"uv pip install --target {PYTHON_TARGET}"
    generated: dict[str, str] = {}
    dependency_files: tuple[str, ...]
    if "requirements.txt" in files:
        reason, dependency_files = "requirements.txt", ("requirements.txt",)
        install = f"{target} -r requirements.txt"
        deps = requirement_names(files["requirements.txt"].splitlines())
    elif "uv.lock" in files:
        reason, dependency_files = "pyproject.toml + uv.lock", ("pyproject.toml", "uv.lock")
        install = (
            f"uv export --frozen --no-dev --no-emit-project --no-hashes -o {GENERATED_REQUIREMENTS} && "
            f"{target} -r {GENERATED_REQUIREMENTS}"
        )
        deps = requirement_names(str(d) for d in project.get("dependencies") or [])
    elif "poetry.lock" in files:
        reason, dependency_files = "pyproject.toml + poetry.lock", ("pyproject.toml", "poetry.lock")
        generated[GENERATED_REQUIREMENTS] = poetry_requirements(files["poetry.lock"])
        install = f"{target} --no-deps -r {GENERATED_REQUIREMENTS}"
        deps = {_normalized(name) for name in poetry_deps} | requirement_names(
            str(d) for d in project.get("dependencies") or []
        )
    else:
        reason, dependency_files = "pyproject.toml", ("pyproject.toml",)
        install = f"{target} -r pyproject.toml"
        deps = requirement_names(str(d) for d in project.get("dependencies") or [])
    start, source = _python_start(files, deps)
    return BuildPlan(
        provider="python",
        reason=reason,
        install=install,
        start=start,
        start_source=source,
        python=_python_request(files, pyproject),
        dependency_files=dependency_files,
        dependency_dir=DEPENDENCY_DIR_PYTHON,
        generated=generated,
    )


def _module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _find_app(files: SourceFiles, constructor: str) -> str:
    """``module:variable`` of the first ``<variable> = <constructor>(`` in the usual entry files."""
    pattern = re.compile(rf"^(\w+)\s*(?::[^=]+)?=\s*{constructor}\(", re.MULTILINE)
    for path in (*_PYTHON_ENTRY_FILES, "app/main.py"):
        match = pattern.search(files.get(path, ""))
        if match:
            return f"{_module_of(path)}:{match.group(1)}"
    return ""


def _python_start(files: SourceFiles, deps: set[str]) -> tuple[str, str]:
    if "manage.py" in files:
        wsgi = next((p for p in sorted(files) if p.count("/") == 1 and p.endswith("/wsgi.py")), "")
        if wsgi and "gunicorn" in deps:
            return f"gunicorn {_module_of(wsgi)} --bind 0.0.0.0:$PORT", "inferred (Django)"
        return "python manage.py runserver 0.0.0.0:$PORT", "inferred (Django)"
    fastapi = _find_app(files, "FastAPI") if "fastapi" in deps else ""
    if fastapi:
        return f"uvicorn {fastapi} --host 0.0.0.0 --port $PORT", "inferred (FastAPI)"
    flask = _find_app(files, "Flask") if "flask" in deps else ""
    if flask and "gunicorn" in deps:
        return f"gunicorn {flask} --bind 0.0.0.0:$PORT", "inferred (Flask)"
    if flask:
        return f"flask --app {flask} run --host 0.0.0.0 --port $PORT", "inferred (Flask)"
    return "", ""


def _node(files: SourceFiles) -> BuildPlan:
    try:
        package = json.loads(files["package.json"])
    except ValueError as exc:
        raise PlanError(f"package.json: {exc}") from exc
    if not isinstance(package, dict):
        raise PlanError("package.json: not a JSON object")
    scripts: dict[str, Any] = package["scripts"] if isinstance(package.get("scripts"), dict) else {}
    if "package-lock.json" in files or "npm-shrinkwrap.json" in files:
        lock = "package-lock.json" if "package-lock.json" in files else "npm-shrinkwrap.json"
        install, reason = "npm ci", f"package.json + {lock}"
    elif "yarn.lock" in files:
        lock, install, reason = "yarn.lock", "npx --yes yarn@1 install --frozen-lockfile", "package.json + yarn.lock"
    elif "pnpm-lock.yaml" in files:
        lock, install = "pnpm-lock.yaml", "npx --yes pnpm@9 install --frozen-lockfile"
        reason = "package.json + pnpm-lock.yaml"
    else:
        lock, install, reason = "", "npm install", "package.json"
    main = package.get("main") if isinstance(package.get("main"), str) else ""
    entry = next((f for f in _NODE_ENTRY_FILES if f in files), "")
    if isinstance(scripts.get("start"), str) and scripts["start"].strip():
        # The script itself, not ``npm start``: no npm process per instance, and no npm in the docker runtime's
        # Node base image (node_modules/.bin is on PATH through the image's entrypoint, as npm would put it).
        steps = [str(scripts[name]).strip() for name in ("prestart", "start") if isinstance(scripts.get(name), str)]
        start, source = " && ".join(step for step in steps if step), "inferred (package.json scripts.start)"
    elif main or entry:
        start, source = f"node {main or entry}", "inferred (Node entry file)"
    else:
        start, source = "", ""
    return BuildPlan(
        provider="node",
        reason=reason,
        install=install,
        build="npm run build" if "build" in scripts else "",
        start=start,
        start_source=source,
        dependency_files=("package.json", lock) if lock else ("package.json",),
        dependency_dir=DEPENDENCY_DIR_NODE,
    )


def _detected(files: SourceFiles, *, use_dockerfile: bool) -> BuildPlan:
    if "Dockerfile" in files and use_dockerfile:
        return BuildPlan(
            provider="dockerfile",
            reason="Dockerfile",
            error=(
                "a Dockerfile build needs a builder with a Docker daemon (the docker runtime, docs/containers.md), "
                "which this builder does not have: deploy a built image with --image, or remove the Dockerfile to "
                "use stack detection"
            ),
        )
    if "requirements.txt" in files or "pyproject.toml" in files:
        return _python(files)
    if "package.json" in files:
        return _node(files)
    if "index.html" in files:
        return BuildPlan(
            provider="static",
            reason="index.html",
            start='python3 -m http.server "$PORT" --bind 0.0.0.0',
            start_source="inferred (static site)",
        )
    if "Procfile" in files:
        return BuildPlan(provider="procfile", reason="Procfile")
    return BuildPlan(provider="none")


def _commands(manifest: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``[build]`` and ``[run]`` tables of a zattera.toml; PlanError naming a step that is not a string."""
    build_table = _table(manifest, "build") or _table(manifest, "app", "build")
    run_table = _table(manifest, "run")
    for table, name, key in (
        (build_table, "build", "install"),
        (build_table, "build", "command"),
        (run_table, "run", "command"),
    ):
        if key in table and not isinstance(table[key], str):
            raise PlanError(f"zattera.toml: [{name}] {key} must be a string (a shell command), not {table[key]!r}")
    return build_table, run_table


def detect(files: SourceFiles) -> BuildPlan:
    """The plan for a source; raises :class:`PlanError` for a malformed file it has to read."""
    manifest = _toml(files, "zattera.toml")
    build_table, run_table = _commands(manifest)
    # A zattera.toml giving any step asks for this builder: a Dockerfile next to it is then not the recipe.
    configured = any(isinstance(t.get(k), str) for t, k in ((build_table, "install"), (build_table, "command")))
    configured = configured or bool(str(run_table.get("command") or "").strip())
    plan = _detected(files, use_dockerfile=not configured)
    changes: dict[str, Any] = {}
    if isinstance(build_table.get("install"), str):
        changes["install"] = build_table["install"].strip()
    if isinstance(build_table.get("command"), str):
        changes["build"] = build_table["command"].strip()
    web = procfile_web(files.get("Procfile", ""))
    if isinstance(run_table.get("command"), str) and run_table["command"].strip():
        changes.update(start=run_table["command"].strip(), start_source="zattera.toml [run] command")
    elif web:
        changes.update(start=web, start_source="Procfile web:")
    if changes:
        plan = replace(plan, **changes)
    if not plan.start and plan.provider in ("python", "node") and not plan.error:
        plan = replace(
            plan,
            error=(
                f"no start command for this {plan.provider} app: add a Procfile line `web: <command>` or "
                '`[run] command = "..."` to zattera.toml'
            ),
        )
    return plan


def build_problem(plan: BuildPlan, *, docker: bool | None) -> str:
    """Why a build of ``plan`` fails ("" when it does not): the message the builder fails the build with.
    ``docker``: whether the builder has a Docker daemon (a Dockerfile source needs one); None = unknown
    (``zattera deploy``, before a builder is chosen): a Dockerfile source is then not refused."""
    if not plan.error or (plan.provider == "dockerfile" and docker is not False):
        return ""
    return plan.error


def check_source(files: SourceFiles, *, docker: bool | None = None) -> BuildPlan:
    """The plan of a source a build would succeed in planning; :class:`PlanError` with the message the build
    would fail with otherwise (a malformed file, a step that is not a string, no start command…). The one
    validation the builder and ``zattera deploy`` (before uploading) share."""
    plan = detect(files)
    if problem := build_problem(plan, docker=docker):
        raise PlanError(problem)
    return plan
