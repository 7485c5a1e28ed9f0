"""A hostile app for the isolation tests: it tries to take whatever it can reach and reports all it got.

Standard library only (it runs on the node's Python, in a sandbox, in a container and as a build step).
It tries to

* open every file and list every directory under each path of ``SPY_PATHS`` (``:``-separated: the data
  directory, the node's credential, …), keeping what it read;
* read the ``environ`` of every process its ``/proc`` shows, but its own;
* talk to NATS without a credential at each ``host:port`` of ``SPY_NATS`` (``CONNECT {}`` then ``PING``);
* connect to each Unix socket of ``SPY_SOCKETS`` (Docker daemons) and ask for ``GET /version``;

and reports its identity (uid, groups, capabilities, ``NoNewPrivs``) and what it saw, as JSON: one line
``SPY-REPORT {...}`` on stdout, and on ``GET /`` when it serves (``$PORT`` set). ``--build`` (a build step):
write the report to ``build-report.json`` in the working directory instead, so the image carries it and
the running spy serves it too (``GET /build``). The variables may also come from a ``spy.env`` file
(``NAME=value`` lines) beside it: a build step gets no configuration.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import sys
from pathlib import Path

MAX_FILE = 64 * 1024
MAX_FILES = 20_000
MAX_BYTES = 8 * 1024 * 1024


def identity() -> dict[str, object]:
    status = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"):
                status[key] = value.strip()
    except OSError as exc:
        status["error"] = repr(exc)
    return {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "status": status, "pid": os.getpid()}


def take_files(roots: list[str]) -> dict[str, object]:
    read: dict[str, str] = {}
    listed: dict[str, list[str]] = {}
    refused: list[str] = []
    count = total = 0

    def grab(path: str) -> None:
        nonlocal count, total
        count += 1
        if count > MAX_FILES or total > MAX_BYTES:
            return
        try:
            with open(path, "rb") as f:
                read[path] = f.read(MAX_FILE).decode("utf-8", "replace")
                total += len(read[path])
        except OSError as exc:
            refused.append(f"{path}: {exc.strerror}")

    for root in roots:
        if os.path.isfile(root) or not os.path.exists(root):
            grab(root)
            continue
        for directory, dirs, files in os.walk(root, onerror=lambda exc: refused.append(f"{exc.filename}: {exc}")):
            listed[directory] = sorted(dirs + files)
            for name in files:
                grab(os.path.join(directory, name))
    return {"read": read, "listed": listed, "refused": refused[:200]}


def take_environs() -> dict[str, object]:
    me = os.getpid()
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    environ: dict[str, str] = {}
    for pid in pids:
        if pid == me:
            continue
        try:
            environ[str(pid)] = Path(f"/proc/{pid}/environ").read_bytes().decode("utf-8", "replace")
        except OSError:
            pass
    return {"pids": pids, "environ": environ}


def talk_nats(address: str) -> str:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=3) as sock:
            sock.settimeout(3)
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
            answer = b""
            try:
                while b"PONG" not in answer and b"-ERR" not in answer:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
            except OSError as exc:
                answer += f" ({exc})".encode()
            return answer.decode("utf-8", "replace").strip() or "(closed)"
    except OSError as exc:
        return f"unreachable: {exc}"


def talk_docker(path: str) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(3)
            sock.connect(path)
            sock.sendall(b"GET /version HTTP/1.0\r\nHost: docker\r\n\r\n")
            return sock.recv(4096).decode("utf-8", "replace")
    except OSError as exc:
        return f"unreachable: {exc}"


def settings() -> None:
    """``spy.env`` beside the script, for what the environment does not set."""
    path = Path(__file__).with_name("spy.env")
    if path.exists():
        for line in path.read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep:
                os.environ.setdefault(name.strip(), value.strip())


def spy() -> dict[str, object]:
    settings()
    paths = [p for p in os.environ.get("SPY_PATHS", "").split(":") if p]
    nats = [a for a in os.environ.get("SPY_NATS", "").split(",") if a]
    sockets = [s for s in os.environ.get("SPY_SOCKETS", "").split(",") if s]
    return {
        "identity": identity(),
        "files": take_files(paths),
        "proc": take_environs(),
        "nats": {a: talk_nats(a) for a in nats},
        "docker": {s: talk_docker(s) for s in sockets},
    }


def serve(report: dict[str, object]) -> None:
    body = json.dumps(report).encode()
    build = Path("build-report.json")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/build":
                payload = build.read_bytes() if build.exists() else b"{}"
            elif self.path == "/healthz":
                payload = b"ok"
            else:
                payload = body
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    bind = os.environ.get("ZATTERA_BIND_ADDR", "127.0.0.1")
    http.server.ThreadingHTTPServer((bind, int(os.environ["PORT"])), Handler).serve_forever()


def main() -> None:
    report = spy()
    if "--build" in sys.argv:
        Path("build-report.json").write_text(json.dumps(report))
        print("spy: build step report written", flush=True)
        return
    print("SPY-REPORT " + json.dumps(report), flush=True)
    if os.environ.get("PORT"):
        serve(report)


if __name__ == "__main__":
    main()
