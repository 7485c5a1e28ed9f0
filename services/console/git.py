"""``git push`` to the console (docs/git.md): git's smart HTTP protocol on the console's own listener.

* ``/git/<project>/<app>.git/...`` is served by git's own ``git http-backend`` (a CGI run per request, its
  output streamed back as it comes), over repositories kept under the console's data dir
  (``<data dir>/console/git/repos/<project>/<app>.git``, bare, created on the first request).
* Every request needs HTTP basic auth with a console user (``zattera console add-user``): pushing needs the
  admin role, fetching any role. Wrong credentials answer 401 and count against the login rate limit;
  checked passwords are remembered (as a SHA-256) for a minute so the requests of one push cost one bcrypt.
* Each repository's ``pre-receive`` hook (a stdlib Python script written by the console) sends the pushed
  updates over a unix socket back to the console with the push's one-time token; the console deploys each
  pushed commit to the env(s) mapped to its branch (``Environment.git_branch``) through
  :func:`shared.actions.gitdeploy.deploy_commit`, streaming the progress lines back: the hook prints them,
  git sends them to the pusher as ``remote: …`` lines, and the hook's exit status (non-zero when a deploy
  failed or the branch is mapped to no env) refuses the push. The hook's quarantined objects are read through
  its ``GIT_OBJECT_DIRECTORY`` / ``GIT_ALTERNATE_OBJECT_DIRECTORIES``, passed along with the updates.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from services.console.auth import LoginLimiter
from shared.actions.context import ActionContext
from shared.actions.gitdeploy import GitDeployFailed, deploy_commit
from shared.actions.gitmap import app_named, decide_updates
from shared.actions.refusals import ActionRefused
from shared.clock import Clock
from shared.connection import Connection
from shared.console_users import ADMIN, burn_check, load_user, password_matches
from shared.gitsource import branch_of, git, redact
from shared.state.reader import StateReader

log = logging.getLogger(__name__)

GIT_PATH = re.compile(r"^/git/(?P<project>[a-z0-9][a-z0-9-]*)/(?P<app>[a-z0-9][a-z0-9-]*)\.git(?P<rest>/.*)?$")
REALM = 'Basic realm="zattera git", charset="UTF-8"'
VERIFIED_TTL = 60.0
"""A checked user name and password are taken as valid this long (seconds) without another bcrypt."""
DEPLOY_TIMEOUT = 1800.0
"""A push waits at most this long (seconds) for its deploy to be live."""
ENDPOINT_KEY = "git.endpoint"
"""Key of the ``zattera-console`` bucket where the console records its URL (``zattera git remote`` reads it)."""
_ALLOWED_SERVICES = ("git-upload-pack", "git-receive-pack")

HOOK_SCRIPT = """#!{python}
# Written by the Zattera console (services/console/git.py): deploys each pushed branch before it is accepted.
import json, os, socket, sys

updates = [line.split() for line in sys.stdin.read().splitlines() if line.strip()]
names = ("GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_QUARANTINE_PATH")
request = {{
    "token": os.environ.get("ZATTERA_GIT_HOOK_TOKEN", ""),
    "updates": updates,
    "env": {{name: os.environ[name] for name in names if name in os.environ}},
}}
code = 1
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(os.environ["ZATTERA_GIT_HOOK_SOCKET"])
        conn.sendall(json.dumps(request).encode() + b"\\n")
        for raw in conn.makefile("rb"):
            message = json.loads(raw)
            if "line" in message:
                print(message["line"], flush=True)
            if "exit" in message:
                code = int(message["exit"])
                break
except (OSError, KeyError, ValueError) as exc:
    print(f"zattera: the console did not answer the push hook ({{exc}})", flush=True)
sys.exit(code)
"""


@dataclass
class Push:
    """One authenticated receive-pack request, known to its hook by a one-time token."""

    user: str
    project: str
    app: str
    repo: Path


@dataclass
class _Verified:
    role: str
    until: float


@dataclass
class GitService:
    root: Path
    """``<data dir>/console/git``: ``repos/`` below it."""
    conn: Connection
    view: StateReader
    actions: ActionContext
    limiter: LoginLimiter
    clock: Clock
    pushes: dict[str, Push] = field(default_factory=dict)
    _verified: dict[str, _Verified] = field(default_factory=dict)
    _server: asyncio.AbstractServer | None = None
    _socket_dir: Path | None = None

    @property
    def repos(self) -> Path:
        return self.root / "repos"

    @property
    def socket_path(self) -> Path:
        assert self._socket_dir is not None, "GitService.start() first"
        return self._socket_dir / "hook.sock"

    async def start(self) -> None:
        self.repos.mkdir(parents=True, exist_ok=True)
        # A short private directory: a unix socket path must stay under ~100 bytes, the data dir may not.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="zattera-git-"))
        self._server = await asyncio.start_unix_server(self._hook_client, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    # ------------------------------------------------------------------ repositories

    async def repo(self, project: str, app: str) -> Path:
        """The app's bare repository, created (and its hook written) when missing."""
        path = self.repos / project / f"{app}.git"
        if not await asyncio.to_thread((path / "HEAD").exists):
            await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            await git("init", "--quiet", "--bare", str(path))
            for key, value in (("receive.denyDeletes", "true"), ("http.receivepack", "true")):
                await git("config", key, value, cwd=path)
        await asyncio.to_thread(_write_hook, path / "hooks" / "pre-receive", HOOK_SCRIPT.format(python=sys.executable))
        return path

    # ------------------------------------------------------------------ credentials

    def _key(self, name: str, password: str) -> str:
        return hashlib.sha256(f"{name}\x00{password}".encode()).hexdigest()

    async def authenticate(self, request: web.Request) -> tuple[str, str] | web.Response:
        """(user, role) of the request's basic credentials, or the response refusing it."""
        header = request.headers.get("Authorization", "")
        if not header.lower().startswith("basic "):
            return _unauthorized("authentication required: a console user's name and password")
        try:
            name, _, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return _unauthorized("malformed basic credentials")
        address = request.remote or "?"
        now = self.clock.now()
        key = self._key(name, password)
        known = self._verified.get(key)
        if known is not None and known.until > now:
            return name, known.role
        wait = self.limiter.retry_after(address, name)
        if wait > 0:
            return web.Response(
                status=429,
                text=f"too many failed logins: try again in {int(wait) + 1} s\n",
                headers={"Retry-After": str(int(wait) + 1)},
            )
        user = await load_user(self.conn.js, name)
        loop = asyncio.get_running_loop()
        if user is None:
            await loop.run_in_executor(None, burn_check, password)
            ok = False
        else:
            ok = await loop.run_in_executor(None, password_matches, user, password)
        if user is None or not ok:
            self.limiter.failed(address, name)
            log.info("git: refused credentials for %r from %s", name, address)
            return _unauthorized("wrong user name or password")
        self.limiter.succeeded(name)
        self._verified = {k: v for k, v in self._verified.items() if v.until > now}
        self._verified[key] = _Verified(user.role, now + VERIFIED_TTL)
        return user.name, user.role

    # ------------------------------------------------------------------ HTTP

    async def handle(self, request: web.Request) -> web.StreamResponse:
        match = GIT_PATH.match(request.path)
        if match is None:
            return web.Response(status=404, text="not a git repository path: /git/<project>/<app>.git\n")
        service = request.query.get("service", "") if request.method == "GET" else (match["rest"] or "")[1:]
        pushing = service == "git-receive-pack"
        if request.method == "POST" and service not in _ALLOWED_SERVICES:
            return web.Response(status=404, text="unknown git service\n")
        auth = await self.authenticate(request)
        if isinstance(auth, web.Response):
            return auth
        user, role = auth
        if pushing and role != ADMIN:
            return web.Response(status=403, text=f"user {user} may not push: the admin role is needed\n")
        project, app = match["project"], match["app"]
        if not _app_exists(self.view, project, app):
            return web.Response(status=404, text=f"no app {project}/{app} (create it with `zattera apps apply`)\n")
        repo = await self.repo(project, app)
        token = ""
        if pushing and request.method == "POST":
            token = secrets.token_urlsafe(24)
            self.pushes[token] = Push(user, project, app, repo)
        try:
            return await self._backend(request, f"/{project}/{app}.git{match['rest'] or ''}", user, token)
        finally:
            self.pushes.pop(token, None)

    async def _backend(self, request: web.Request, path_info: str, user: str, token: str) -> web.StreamResponse:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.repos),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "HOME": str(self.root),
            "PATH_INFO": path_info,
            "REQUEST_METHOD": request.method,
            "QUERY_STRING": request.query_string,
            "CONTENT_TYPE": request.headers.get("Content-Type", ""),
            "REMOTE_USER": user,
            "REMOTE_ADDR": request.remote or "",
            "ZATTERA_GIT_HOOK_SOCKET": str(self.socket_path),
            "ZATTERA_GIT_HOOK_TOKEN": token,
        }
        # aiohttp hands the body over decoded (a gzip'd request inflated): its length is then unknown, and
        # http-backend reads to the end of its input.
        if "Content-Length" in request.headers and "Content-Encoding" not in request.headers:
            env["CONTENT_LENGTH"] = request.headers["Content-Length"]
        if "Git-Protocol" in request.headers:
            env["GIT_PROTOCOL"] = request.headers["Git-Protocol"]
        proc = await asyncio.create_subprocess_exec(
            "git", "http-backend", env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        feeding = asyncio.create_task(_feed(request, proc.stdin))
        errors = asyncio.create_task(proc.stderr.read())
        response: web.StreamResponse | None = None
        try:
            status, headers, rest = await _cgi_headers(proc.stdout)
            response = web.StreamResponse(status=status, headers=headers)
            await response.prepare(request)
            if rest:
                await response.write(rest)
            while chunk := await proc.stdout.read(65536):
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            feeding.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeding
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()
            said = (await errors).decode(errors="replace").strip()
            if said and proc.returncode:
                log.info("git http-backend %s: %s", path_info, redact(said.splitlines()[-1]))

    # ------------------------------------------------------------------ the pre-receive hook

    async def _hook_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines: asyncio.Queue[str | None] = asyncio.Queue()

        async def send() -> None:
            while (line := await lines.get()) is not None:
                writer.write(json.dumps({"line": line}).encode() + b"\n")
                await writer.drain()

        sender = asyncio.create_task(send())
        code = 1
        try:
            raw = await reader.readline()
            request = json.loads(raw) if raw else {}
            push = self.pushes.get(str(request.get("token", "")))
            if push is None:
                lines.put_nowait("zattera: refused: this push is not known to the console")
            else:
                code = await self.deploy_updates(
                    push, request.get("updates", []), request.get("env", {}), lines.put_nowait
                )
        except Exception as exc:  # the hook must get an answer: the push fails with the reason
            log.exception("git: the push hook failed")
            lines.put_nowait(f"zattera: internal error: {redact(str(exc))}")
        finally:
            lines.put_nowait(None)
            with contextlib.suppress(Exception):
                await sender
            with contextlib.suppress(Exception):
                writer.write(json.dumps({"exit": code}).encode() + b"\n")
                await writer.drain()
                writer.close()

    async def deploy_updates(
        self, push: Push, updates: list[list[str]], git_env: dict[str, str], say: Callable[[str], None]
    ) -> int:
        """Deploy each pushed branch to its env(s); the hook's exit status (0: accept the push)."""
        decided = decide_updates(self.view, push.project, push.app, [tuple(u) for u in updates if len(u) == 3])
        if decided.refusal:
            say(decided.refusal)
            return 1
        actor = self.actions.acting_as(f"console:{push.user}")
        quarantine = {k: v for k, v in git_env.items() if k.startswith("GIT_") and isinstance(v, str)}
        failed = False
        for sha, ref, env_name in decided.deploys:
            say(f"zattera: deploying {sha[:12]} ({branch_of(ref)}) to {push.project}/{push.app}/{env_name}")
            try:
                done = await deploy_commit(
                    actor,
                    project=push.project,
                    app=push.app,
                    env=env_name,
                    repo_path_or_url=str(push.repo),
                    commit_sha=sha,
                    ref=ref,
                    author="",
                    message="",
                    progress=say,
                    timeout=DEPLOY_TIMEOUT,
                    git_env=quarantine,
                )
            except (GitDeployFailed, ActionRefused) as exc:
                say(f"zattera: refused: {exc}")
                failed = True
                continue
            if not done.live:
                say(f"zattera: deploy of {sha[:12]} to {done.env} failed: {done.error}")
                failed = True
        if failed:
            say("zattera: push refused (the branch keeps its previous commit; the env keeps serving its release)")
        return 1 if failed else 0


def _app_exists(view: StateReader, project: str, app: str) -> bool:
    return app_named(view, project, app) is not None


def _write_hook(hook: Path, text: str) -> None:
    if not hook.exists() or hook.read_text() != text:
        hook.parent.mkdir(exist_ok=True)
        hook.write_text(text)
        hook.chmod(0o755)


def _unauthorized(text: str) -> web.Response:
    return web.Response(status=401, text=text + "\n", headers={"WWW-Authenticate": REALM})


async def _feed(request: web.Request, stdin: asyncio.StreamWriter) -> None:
    try:
        async for chunk in request.content.iter_chunked(65536):
            stdin.write(chunk)
            await stdin.drain()
    finally:
        with contextlib.suppress(Exception):
            stdin.close()


async def _cgi_headers(stdout: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The CGI response's status and headers (``Status:`` → status), and the body bytes read past them."""
    buffer = b""
    while True:
        for sep in (b"\r\n\r\n", b"\n\n"):
            if sep in buffer:
                head, rest = buffer.split(sep, 1)
                return (*_parse_head(head), rest)
        chunk = await stdout.read(65536)
        if not chunk:
            return 502, {"Content-Type": "text/plain"}, b"git http-backend gave no response\n"
        buffer += chunk


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status, headers = 200, {}
    for line in head.decode("latin-1").splitlines():
        name, _, value = line.partition(":")
        if name.lower() == "status":
            status = int(value.strip().split()[0])
        elif name.strip():
            headers[name.strip()] = value.strip()
    return status, headers
