"""What starting a proxy needs to know without loading the proxy: where it listens and which data plane it runs.

Light on purpose (the standard library only): ``zattera up``'s supervisor (``python -m cli.up``) stays resident
for as long as the cluster runs and reads these, and importing the proxy's settings (pydantic-settings) or its
HAProxy engine (the whole proxy, nats-py, aiohttp) would cost it ~40 MB of a single machine's control plane
(PERFORMANCE.md, "footprint").
"""

from __future__ import annotations

import shutil

DEFAULT_HOST = "0.0.0.0"
"""An ingress listens on every interface unless told otherwise (``--listen 127.0.0.1:8080`` keeps it local)."""
DEFAULT_PORT = 8080
DEFAULT_TLS_LISTEN = "0.0.0.0:8443"
"""Where ``zattera up`` puts the proxy's TLS listener (the proxy process itself has none unless told)."""
HAPROXY = "haproxy"


def split_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; ``:8080`` = every interface) → (host, port); ValueError naming
    what is wrong."""
    host, sep, port_text = value.strip().rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 0.0.0.0:8080 or 127.0.0.1:8080)")
    host = host.removeprefix("[").removesuffix("]") or DEFAULT_HOST
    return host, int(port_text)


def haproxy_binary() -> str | None:
    """The ``haproxy`` executable, or None when it is not installed."""
    return shutil.which(HAPROXY)


def choose_engine(asked: str) -> str | None:
    """The data plane to run: the one asked for, else haproxy when installed, else python; None when
    haproxy is asked for and not installed."""
    if asked == "python":
        return "python"
    if haproxy_binary() is not None:
        return "haproxy"
    return None if asked == "haproxy" else "python"
