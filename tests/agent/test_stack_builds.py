"""Real apps built unchanged: the builder detects the stack, installs real packages from PyPI, and the process
runtime runs the image (FastAPI, Express and static sites: tests/e2e/test_stack_deploys.py; examples/flask on
the docker runtime, through the proxy: tests/e2e/test_docker_flow.py). A missing module is reported on both
runtimes (the docker one on the Python base image it makes from the node's interpreter). Express and a static
site run under the docker runtime on the Node and Python base images it makes from the node's own programs. The package
managers' download caches are shared by the whole session (as on a builder node), so only the first build of a
stack downloads anything."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.builder import Builder
from services.agent.hostbase import NODE_LABEL
from services.agent.pythonbase import PYTHON_LABEL
from shared.applogs import describe_exit
from shared.connection import Connection
from shared.registry import fetch_image
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent, assignment, release
from tests.agent.test_builder import run_build, serving
from tests.agent.test_runtime import http_get, seed, state_of
from tests.waiting import eventually

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, str]:
    return {
        p.relative_to(EXAMPLES / name).as_posix(): p.read_text() for p in (EXAMPLES / name).rglob("*") if p.is_file()
    }


@pytest.fixture(scope="session")
def builder_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("builder-cache")


@pytest.fixture
async def builder(conn: Connection, tmp_path: Path, builder_cache: Path) -> AsyncIterator[Builder]:
    """A builder whose caches (layers, downloads) outlive the test: builds in later tests reuse them."""
    async with serving(Builder(conn, "b1", tmp_path / "builds", os_arch="linux/amd64", cache_dir=builder_cache)) as b:
        yield b


@pytest.fixture(params=["process", "docker"])
def runtime(request: pytest.FixtureRequest) -> dict[str, str]:
    """The agent settings of each runtime (the docker one on the session's private daemon)."""
    if request.param == "process":
        return {"runtime": "process"}
    return {"runtime": "docker", "docker_host": request.getfixturevalue("docker_host")}


def log_lines(events: list[cpb.BuildEvent]) -> list[str]:
    return [e.log.line for e in events if e.log.line]


def image_of(events: list[cpb.BuildEvent]) -> str:
    assert events[-1].done and not events[-1].error, events[-1].error
    digest = next(e.image_digest for e in events if e.image_digest)
    return f"p1/a1@{digest}"


async def serve_and_get(
    image_ref: str, view: StateView, writer: Writer, start_agent: StartAgent, runtime: Mapping[str, str] | None = None
) -> str:
    """Run the image on an agent (of ``runtime``'s settings, else the process runtime) and return what GET /
    answers."""
    await start_agent("n1", **(runtime or {}))
    rel = release(image_ref, healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)
    try:
        await eventually(
            lambda: state_of(view, "n1", a.meta.id) in (pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY),
            timeout=30,
        )
    except AssertionError:
        raise AssertionError(f"not running: {view.observed('n1', a.meta.id)}") from None
    port = view.observed("n1", a.meta.id).mesh_port_bindings["http"]  # type: ignore[union-attr]
    answer: list[str] = []

    async def answered() -> bool:
        try:
            answer.append(await http_get(port))
        except OSError:
            return False
        return "hello" in answer[-1]

    await eventually(answered, what="the app answers", timeout=30)
    return answer[-1]


async def test_flask_app_builds_unchanged_runs_and_reuses_its_dependency_layer(
    builder: Builder, conn: Connection, view: StateView, writer: Writer, start_agent: StartAgent
) -> None:
    files = example("flask")
    events = await run_build(conn, files)
    lines = log_lines(events)
    assert lines[1:5] == [
        "plan: provider python (requirements.txt)",
        "plan: install  uv pip install --target .zattera/python -r requirements.txt",
        "plan: build    (none)",
        "plan: start    gunicorn app:app --bind 0.0.0.0:$PORT  (Procfile web:)",
    ]
    assert "hello from flask" in await serve_and_get(image_of(events), view, writer, start_agent)

    # A code change only: the dependency layer is reused, nothing is installed.
    files["app.py"] = files["app.py"].replace("hello from flask", "hello again from flask")
    again = log_lines(await run_build(conn, files))
    assert any(line.startswith("dependencies: cached layer ") for line in again)
    assert not any(line.startswith("$ uv pip install") for line in again)


@pytest.mark.parametrize(
    ("files", "provider", "label", "program", "answer"),
    [
        (
            example("express"),
            "node",
            NODE_LABEL,
            os.path.realpath(shutil.which("node") or "node"),
            "hello from express",
        ),
        (
            {"index.html": "<h1>hello static</h1>\n"},
            "static",
            PYTHON_LABEL,
            os.path.realpath(sys.executable),
            "hello static",
        ),
    ],
    ids=["express", "static"],
)
async def test_express_and_a_static_site_run_under_the_docker_runtime(
    builder: Builder,
    conn: Connection,
    view: StateView,
    writer: Writer,
    start_agent: StartAgent,
    docker_host: str,
    files: dict[str, str],
    provider: str,
    label: str,
    program: str,
    answer: str,
) -> None:
    """On the base image made from the node's own ``node`` (no npm: the start script runs as it is) or, for
    the static site's ``python3 -m http.server``, its own interpreter."""
    events = await run_build(conn, files)
    assert f"plan: provider {provider}" in log_lines(events)[1]
    config = json.loads((await fetch_image(conn, image_of(events))).config)
    assert config["config"]["Labels"][label] == program  # the program the base image is made from
    docker = {"runtime": "docker", "docker_host": docker_host}
    assert answer in await serve_and_get(image_of(events), view, writer, start_agent, docker)


async def test_a_builder_without_the_layer_takes_it_from_the_cluster_registry(
    conn: Connection, tmp_path: Path, builder_cache: Path
) -> None:
    files = example("flask")
    async with serving(Builder(conn, "b1", tmp_path / "one", os_arch="linux/amd64", cache_dir=builder_cache)):
        await run_build(conn, files)
    # Same node id (the test's request goes to b1), but an empty layer cache: a fresh builder machine.
    fresh = Builder(conn, "b1", tmp_path / "two", os_arch="linux/amd64", cache_dir=tmp_path / "empty-cache")
    async with serving(fresh):
        lines = log_lines(await run_build(conn, files))
    assert any(line.startswith("dependencies: cached layer ") and "(cluster registry)" in line for line in lines)


async def test_a_broken_requirement_fails_the_build_with_the_installers_message(
    builder: Builder, conn: Connection
) -> None:
    events = await run_build(
        conn, {"requirements.txt": "zattera-no-such-package-3f9c==1.0\n", "Procfile": "web: python app.py\n"}
    )
    error = events[-1].error
    assert events[-1].status == pb.BUILD_STATUS_FAILED
    assert error.startswith("builder: install command exited with code 1: ")
    assert "zattera-no-such-package-3f9c" in error and "not found in the package registry" in error


async def test_a_stack_without_a_start_command_asks_for_one(builder: Builder, conn: Connection) -> None:
    events = await run_build(conn, {"package.json": json.dumps({"name": "x"})})
    assert events[-1].error.startswith("builder: no start command for this node app: add a Procfile line")


async def test_an_app_missing_a_module_says_which(
    builder: Builder,
    conn: Connection,
    view: StateView,
    writer: Writer,
    start_agent: StartAgent,
    runtime: dict[str, str],
) -> None:
    files = {
        "requirements.txt": "gunicorn>=22\n",
        "Procfile": "web: python app.py\n",
        "app.py": "import forgotten_dep\n",
    }
    events = await run_build(conn, files)
    await start_agent("n1", **runtime)
    rel = release(image_of(events), healthcheck=False)
    a = assignment("n1", rel)
    await seed(writer, rel, a)

    def crashed() -> bool:
        observed = view.observed("n1", a.meta.id)
        return observed is not None and observed.HasField("last_exit") and observed.last_exit.code_known

    await eventually(crashed, what="the crash reported", timeout=30)
    observed = view.observed("n1", a.meta.id)
    assert observed is not None
    assert "missing module 'forgotten_dep'" in describe_exit(observed.last_exit)
