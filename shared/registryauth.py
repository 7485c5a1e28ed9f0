"""Registry credentials for ``docker://`` image refs, kept as one sealed secret of the environment.

``zattera registry login`` seals ``{"serveraddress", "username", "password"}`` (JSON) as the environment's
secret ``ZATTERA_REGISTRY_AUTH``, exactly as ``zattera secrets set`` seals a value (docs/secrets.md): only
ciphertext in NATS, the version frozen into each release (a rollback pulls with the credentials it was
deployed with), opened only by the node that starts a replica. The name is reserved (``ZATTERA_*``), so no
app secret can take it; the agent takes it out of the secrets before it builds the process environment, and
hands it to the Docker daemon's pull (the ``X-Registry-Auth`` header), only for an image of that registry.
Nothing logs it: errors name the server and the field, never the value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from shared.appconfig import ConfigError

REGISTRY_AUTH_SECRET = "ZATTERA_REGISTRY_AUTH"
DOCKER_HUB = "docker.io"
DOCKER_HUB_ALIASES = frozenset({"index.docker.io", "registry-1.docker.io"})
_HOST = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$")


def registry_auth_value(server: str, username: str, password: str) -> str:
    """The secret's value; ConfigError naming the bad field (never showing the password)."""
    if not _HOST.match(server):
        raise ConfigError("server", f"{server!r} is not a registry host (host or host:port, e.g. ghcr.io)")
    if not username or any(c in username for c in "\r\n\0"):
        raise ConfigError("--username", "must be one non-empty line")
    if not password or "\0" in password:
        raise ConfigError("password", "must not be empty")
    server = DOCKER_HUB if server in DOCKER_HUB_ALIASES else server
    return json.dumps({"serveraddress": server, "username": username, "password": password})


def registry_of(image: str) -> str:
    """The registry host a Docker image name is pulled from (``docker.io`` for a name without one)."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return first
    return DOCKER_HUB


def split_registry_auth(secrets: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str] | None]:
    """The secrets that go into the process environment, and the registry credentials (None: none or not
    readable as such: a pull then goes without them, as before any login)."""
    rest = {name: value for name, value in secrets.items() if name != REGISTRY_AUTH_SECRET}
    raw = secrets.get(REGISTRY_AUTH_SECRET)
    if raw is None:
        return rest, None
    try:
        doc = json.loads(raw)
    except ValueError:
        return rest, None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k in ("serveraddress", "username")):
        return rest, None
    return rest, {k: str(v) for k, v in doc.items() if k in ("serveraddress", "username", "password")}


def auth_for(image: str, auth: Mapping[str, str] | None) -> dict[str, str] | None:
    """The credentials to send with a pull of ``image``: only to the registry they were given for."""
    if auth is None or auth.get("serveraddress") != registry_of(image):
        return None
    return dict(auth)
