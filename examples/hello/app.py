"""A tiny HTTP app for Zattera's quick start: answers on $ZATTERA_BIND_ADDR:$PORT (the node's mesh address
and the port the agent gave it), /healthz for the health check. $HELLO_START_DELAY seconds (default 0) pass
before it listens: a release that takes that long to become healthy, to watch a rollout's health gating."""

from __future__ import annotations

import json
import os
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = os.environ.get("HELLO_VERSION", "v1")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/healthz":
            body = b"ok"
        else:
            body = json.dumps(
                {
                    "hello": "world",
                    "version": VERSION,
                    "host": socket.gethostname(),
                    "node": os.environ.get("ZATTERA_NODE_ID", ""),
                    "pid": os.getpid(),
                }
            ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json" if self.path != "/healthz" else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


if __name__ == "__main__":
    time.sleep(float(os.environ.get("HELLO_START_DELAY", "0")))
    bind = os.environ.get("ZATTERA_BIND_ADDR", "127.0.0.1")  # where the routes send requests for this replica
    server = ThreadingHTTPServer((bind, int(os.environ.get("PORT", "8000"))), Handler)
    # The moment it can answer (benchmarks/e2e_bench.py subtracts the app's own start from a cold start).
    print(f"hello {VERSION} listening on {server.server_port} (ready at {time.time():.6f})", flush=True)
    server.serve_forever()
