"""What earlier releases' clusters were made of (captured from real clusters by ``tests/compat/capture.py``)
and how to rebuild one on a real nats-server: their streams, created with the configuration and metadata
they had, so a test can upgrade it.

* ``releases/v0.1.0/``: a cluster ``zattera up`` of 0.1.0 (commit a1c29d0) made, with examples/hello
  deployed (``streams.json``), that release's subjects (``subjects.json``) and ``.proto`` files;
* ``releases/pre-v0.1.0-31c8706/``: one made by commit 31c8706 (issue 44's reproduction: build events on
  ``zattera.builds.*.events``, rollups allowed on the live bucket, no recorded configuration).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.connection import Connection
from shared.provisioning import js_api

RELEASES = Path(__file__).parent / "releases"
PREVIOUS = "v0.1.0"
"""The release before this one: its protos and subjects are what the wire-contract test holds us to."""
PRE_0_1 = "pre-v0.1.0-31c8706"
PER_ENV = "<env>"
"""Stands for an environment id in a captured per-env stream's name and subjects."""


def streams(release: str) -> dict[str, dict[str, Any]]:
    """``{stream: {"config": server JSON, "metadata": {...}}}`` of ``release``'s cluster."""
    loaded: dict[str, dict[str, Any]] = json.loads((RELEASES / release / "streams.json").read_text())
    return loaded


async def recreate(conn: Connection, release: str, *, env_id: str = "E1") -> list[str]:
    """Create on this (empty) server every stream ``release``'s cluster had, as it had them (per-env streams
    for ``env_id``); returns their names."""
    made = []
    for name, captured in streams(release).items():
        config = dict(captured["config"])
        if captured["metadata"]:
            config["metadata"] = captured["metadata"]
        if PER_ENV in name:
            name = name.replace(PER_ENV, env_id)
            config["name"] = name
            config["subjects"] = [s.replace(PER_ENV, env_id) for s in config["subjects"]]
        await js_api(conn.nc, f"STREAM.CREATE.{name}", config)
        made.append(name)
    return made
