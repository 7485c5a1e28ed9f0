"""A git repository served on loopback over smart HTTP: git's own ``git http-backend`` (CGI) behind a tiny
aiohttp server, optionally requiring an ``Authorization`` header (a private repository's token); and a
loopback stand-in of a git host's commit-status API that records what it is sent."""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web


def git(cwd: Path, *args: str) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
        "GIT_AUTHOR_NAME": "Ada Lovelace",
        "GIT_AUTHOR_EMAIL": "ada@example.com",
        "GIT_COMMITTER_NAME": "Ada Lovelace",
        "GIT_COMMITTER_EMAIL": "ada@example.com",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return done.stdout.strip()


@dataclass
class Repo:
    """A work tree and the bare repository it pushes to (what the server serves)."""

    work: Path
    bare: Path

    @classmethod
    def create(cls, root: Path, name: str = "app.git") -> Repo:
        bare = root / "served" / name
        bare.mkdir(parents=True)
        git(bare, "init", "-q", "--bare", "-b", "main")
        work = root / "work"
        work.mkdir()
        git(work, "init", "-q", "-b", "main")
        git(work, "remote", "add", "origin", str(bare))
        return cls(work, bare)

    def commit(self, files: dict[str, str], message: str, branch: str = "main") -> str:
        current = git(self.work, "symbolic-ref", "--short", "HEAD")
        if current != branch:
            exists = subprocess.run(["git", "rev-parse", "--verify", "-q", branch], cwd=self.work, capture_output=True)
            git(self.work, "checkout", "-q", *([] if exists.returncode == 0 else ["-b"]), branch)
        for name, text in files.items():
            path = self.work / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        git(self.work, "add", "-A")
        git(self.work, "commit", "-q", "-m", message)
        git(self.work, "push", "-q", "origin", f"{branch}:{branch}")
        return git(self.work, "rev-parse", "HEAD")


class GitHttpServer:
    """``<url>/<name>.git`` for each bare repository under ``root``."""

    def __init__(self, root: Path, required_auth: str = "") -> None:
        self.root = root
        self.required_auth = required_auth
        self.auth_seen: list[str] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        self.auth_seen.append(auth)
        if self.required_auth and auth != self.required_auth:
            return web.Response(status=401, headers={"WWW-Authenticate": 'Basic realm="git"'})
        body = await request.read()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": request.method,
            "PATH_INFO": request.path,
            "QUERY_STRING": request.query_string,
            "CONTENT_TYPE": request.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": request.remote or "127.0.0.1",
            "GIT_PROTOCOL": request.headers.get("Git-Protocol", ""),
            "HTTP_CONTENT_ENCODING": request.headers.get("Content-Encoding", ""),
        }
        proc = await asyncio.create_subprocess_exec(
            "git", "http-backend", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        out, _ = await proc.communicate(body)
        head, _, payload = out.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = out.partition(b"\n\n")
        status, headers = 200, {}
        for line in head.decode().splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers[name.strip()] = value.strip()
        return web.Response(status=status, body=payload, headers=headers)

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@dataclass
class StatusCall:
    path: str
    headers: dict[str, str]
    body: dict[str, str]


@dataclass
class StatusApi:
    """Answers 201 to every POST and records it."""

    calls: list[StatusCall] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        self.calls.append(StatusCall(request.path, dict(request.headers), await request.json()))
        return web.json_response({"id": len(self.calls)}, status=201)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
