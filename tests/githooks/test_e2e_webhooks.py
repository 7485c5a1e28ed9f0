"""Webhooks end to end through ``zattera up`` (a subprocess, as a user runs it): the example app's repository
served on loopback by ``git http-backend`` (token required); ``zattera git hook add`` with previews; a
signed GitHub push delivered to the console's endpoint → that commit built, deployed and answering through
the proxy; a forged delivery refused; a pull request opened → its preview answers on
``pr-<n>.hello.localhost``; closed → the hostname is gone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared import githooks as G
from shared.embedded import free_port
from tests.e2e.cluster import EXAMPLE, version_of
from tests.e2e.upcmd import Up, listen_port
from tests.githooks import payloads as P
from tests.githooks.gitserver import GitHttpServer, Repo
from tests.githooks.rig import TOKEN
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

ENV = "demo/hello/production"


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "zattera-data"
    yield directory
    from tests.e2e.cluster import kill_tree_under

    kill_tree_under(directory, also_matching=str(directory))


async def _get(port: int, host: str) -> tuple[int, str]:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"http://127.0.0.1:{port}/", headers={"Host": host}) as response,
        ):
            return response.status, await response.text()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return 0, repr(exc)


async def _post(url: str, delivery: P.Delivery) -> int:
    async with aiohttp.ClientSession() as session, session.post(url, data=delivery.body, headers=delivery.headers) as r:
        return r.status


def _app(version: str) -> dict[str, str]:
    source = (EXAMPLE / "app.py").read_text().replace('"HELLO_VERSION", "v1"', f'"HELLO_VERSION", "{version}"')
    assert version in source
    return {"app.py": source, "zattera.toml": (EXAMPLE / "zattera.toml").read_text()}


async def test_push_deploys_and_a_pull_request_preview_answers_on_its_hostname_until_closed(
    data_dir: Path, tmp_path: Path
) -> None:
    repo = Repo.create(tmp_path / "git")
    repo.commit(_app("v1"), "First")
    server = GitHttpServer(tmp_path / "git" / "served", required_auth=G.fetch_auth_header("github", TOKEN))
    await server.start()
    clone_url = f"{server.url}/app.git"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    console_port, proxy_port = listen_port(), free_port()
    up = Up(data_dir, free_port(), proxy_port, env={"ZATTERA_CONSOLE_PORT": str(console_port)})
    console = f"http://127.0.0.1:{console_port}"
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 90, "zattera up is up")
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
        argv = (
            "git", "hook", "add", "--env", ENV, "--provider", "github", "--repo", clone_url,
            "--token-file", str(token_file), "--previews", "--console-url", console, "--json",
        )  # fmt: skip
        done: list[str] = []

        def hook_added() -> bool:  # refused until the secrets service has published the cluster key
            run = up.cli(*argv, check=False)
            if run.returncode == 0:
                done.append(run.stdout)
            return bool(done)

        await eventually(hook_added, 90, "git hook add (the cluster's secrets key published)")
        added = json.loads(done[0])
        secret, endpoint = added["secret"], added["url"]
        assert endpoint == f"{console}/hooks/github/{added['id']}"
        listed = up.cli("git", "hook", "list")
        assert added["id"] in listed.stdout and TOKEN not in listed.stdout + listed.stderr

        sha = repo.commit(_app("v2"), "Version 2")
        event, payload = P.push("github", clone_url, sha)
        assert await _post(endpoint, P.signed("github", secret, event, payload)) == 202
        forged_sha = repo.commit(_app("evil"), "Evil")
        event, payload = P.push("github", clone_url, forged_sha)
        assert await _post(endpoint, P.signed("github", "not-the-secret", event, payload)) == 401

        async def serving(host: str, version: str) -> bool:
            status, body = await _get(proxy_port, host)
            return status == 200 and version_of(body) == version

        await eventually(lambda: serving("hello.localhost", "v2"), 180, "the pushed commit serves")
        releases = up.cli("releases", "--env", ENV, "--json").stdout
        assert releases.count('"version"') == 1, releases  # only the genuine push was deployed

        pr_sha = repo.commit(_app("pr-7"), "Feature", branch="feature")
        event, payload = P.pull_request("github", clone_url, pr_sha, 7, "opened")
        assert await _post(endpoint, P.signed("github", secret, event, payload)) == 202
        await eventually(lambda: serving("pr-7.hello.localhost", "pr-7"), 180, "the preview answers on its hostname")
        (hook,) = json.loads(up.cli("git", "hook", "list", "--json").stdout)
        assert hook["previews_live"] == ["pr-7"], hook
        assert await serving("hello.localhost", "v2"), "the base env still serves its own release"

        event, payload = P.pull_request("github", clone_url, pr_sha, 7, "closed")
        assert await _post(endpoint, P.signed("github", secret, event, payload)) == 202

        async def gone() -> bool:
            return (await _get(proxy_port, "pr-7.hello.localhost"))[0] == 404

        await eventually(gone, 60, "the preview's hostname is gone")
        (hook,) = json.loads(up.cli("git", "hook", "list", "--json").stdout)
        assert hook["previews_live"] == [], hook
        logs = "\n".join(p.read_text(errors="replace") for p in (data_dir / "logs").glob("*.log"))
        assert TOKEN not in logs and secret not in logs and TOKEN not in up.text()
        assert up.ctrl_c() == 0, up.text()
    except BaseException:
        print(up.text())
        for log in sorted((data_dir / "logs").glob("*.log")):
            print(f"==> {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        raise
    finally:
        up.kill()
        await server.stop()
        shutil.rmtree(tmp_path / "git", ignore_errors=True)
