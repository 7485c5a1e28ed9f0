"""Real apps deployed unchanged: `zattera deploy DIR` of a Flask, a FastAPI, an Express app and a
static site, each built by stack detection on the builder node with real packages from PyPI and npm and
answering through the ingress proxy; an unchanged-dependency redeploy reuses the cached layer; a broken
requirement fails the deploy with the installer's own message."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.cluster import ROOT, E2ECluster
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ENV = """
[env.production]
replicas = 1
healthcheck = { type = "http", path = "/", interval = "1s", timeout = "2s", grace_period = "20s" }
domains = ["{app}.localhost"]
"""
FASTAPI_MAIN = """
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

app = FastAPI()


@app.get("/", response_class=PlainTextResponse)
def index() -> str:
    return "hello from fastapi"
"""
FASTAPI_PYPROJECT = """
[project]
name = "hello-fastapi"
version = "1.0.0"
dependencies = ["fastapi>=0.110", "uvicorn>=0.30"]
"""


def source(root: Path, app: str, files: dict[str, str], example: str = "") -> Path:
    """An app directory: a copy of ``examples/<example>`` or ``files``, with a zattera.toml of one replica."""
    dest = root / app
    if example:
        shutil.copytree(ROOT / "examples" / example, dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (dest / name).write_text(text)
    (dest / "zattera.toml").write_text(f'project = "stacks"\napp = "{app}"\n' + ENV.replace("{app}", app))
    return dest


async def deploy(cluster: E2ECluster, src: Path, *, check: bool = True) -> str:
    await cluster.acli("apps", "apply", str(src / "zattera.toml"))
    result = await cluster.acli("deploy", str(src), "--env", f"stacks/{src.name}/production", check=check)
    return result.stdout + result.stderr


async def served(cluster: E2ECluster, host: str, text: str) -> None:
    async def answers() -> bool:
        try:
            status, body = await cluster.get(host)
        except (OSError, TimeoutError):  # aiohttp errors are OSErrors: not routed yet
            return False
        return status == 200 and text in body

    await eventually(answers, timeout=30, what=f"{host} answers {text!r}")


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stacks")


async def test_flask_app_deploys_unchanged_and_redeploys_from_its_cached_layer(cluster: E2ECluster, apps: Path) -> None:
    src = source(apps, "flask", {}, example="flask")
    output = await deploy(cluster, src)
    assert "plan: start    gunicorn app:app --bind 0.0.0.0:$PORT  (Procfile web:)" in output, output
    assert "live: release" in output
    await served(cluster, "flask.localhost", "hello from flask")

    (src / "app.py").write_text((src / "app.py").read_text().replace("hello from flask", "hello from flask v2"))
    output = await deploy(cluster, src)
    assert "dependencies: cached layer" in output and "$ uv pip install" not in output, output
    await served(cluster, "flask.localhost", "hello from flask v2")


async def test_fastapi_express_and_static_apps_deploy_unchanged(cluster: E2ECluster, apps: Path) -> None:
    fastapi = source(apps, "fastapi", {"main.py": FASTAPI_MAIN, "pyproject.toml": FASTAPI_PYPROJECT})
    express = source(apps, "express", {}, example="express")
    static = source(apps, "static", {"index.html": "<h1>hello from a static site</h1>\n"})
    for src in (fastapi, express, static):
        output = await deploy(cluster, src)
        assert "live: release" in output, output
    await served(cluster, "fastapi.localhost", "hello from fastapi")
    await served(cluster, "express.localhost", "hello from express")
    await served(cluster, "static.localhost", "hello from a static site")


async def test_a_broken_requirement_fails_the_deploy_with_the_installers_message(
    cluster: E2ECluster, apps: Path
) -> None:
    src = source(apps, "broken", {"requirements.txt": "zattera-no-such-package-3f9c==1.0\n", "Procfile": "web: x\n"})
    output = await deploy(cluster, src, check=False)
    assert "zattera-no-such-package-3f9c" in output and "not found in the package registry" in output, output
