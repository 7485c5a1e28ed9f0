"""Record what a release's cluster is made of, for the compatibility tests: ``python -m tests.compat.capture
--nats URL --out DIR/streams.json`` against a cluster that release initialised (its streams' configurations
as the server has them, volatile fields dropped), and ``--subjects DIR/subjects.json`` with that release's
code on the path (what its subject builders produce). docs/upgrades.md, "Releasing", says when.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

VOLATILE = ("created", "metadata")
"""Dropped from a stream's configuration: when it was made, and the metadata (the recorded configuration,
compared by the tests on its own)."""

SAMPLE_BUILD, SAMPLE_NODE, SAMPLE_ENV, SAMPLE_INSTANCE = "B1", "N1", "E1", "I1"


async def streams(url: str) -> dict[str, Any]:
    from shared.connection import connect
    from shared.provisioning import js_api

    conn = await connect(url, name="capture")
    try:
        names = (await js_api(conn.nc, "STREAM.NAMES")).get("streams") or []
        found = {}
        for name in sorted(names):
            config = (await js_api(conn.nc, f"STREAM.INFO.{name}"))["config"]
            meta = {k: v for k, v in (config.get("metadata") or {}).items() if not k.startswith("_nats.")}
            found[name] = {
                "config": {k: v for k, v in config.items() if k not in VOLATILE},
                "metadata": meta,
            }
        return found
    finally:
        await conn.close()


def subjects() -> dict[str, str]:
    """Every subject builder's output for sample ids, with the code on the path."""
    try:
        from shared import subjects as natsio
    except ImportError:  # releases before the subjects had their own module
        from shared import natsio  # type: ignore[attr-defined,no-redef]

    found = {
        "build_log_subject": natsio.build_log_subject(SAMPLE_BUILD),
        "agent_subject(build)": natsio.agent_subject(SAMPLE_NODE, "build"),
        "ACTIVATE_SUBJECT": natsio.ACTIVATE_SUBJECT,
        "ROUTES_SNAPSHOT_SUBJECT": natsio.ROUTES_SNAPSHOT_SUBJECT,
        "ROUTES_GET_SUBJECT": natsio.ROUTES_GET_SUBJECT,
        "EVENTS_SUBJECT_PREFIX": natsio.EVENTS_SUBJECT_PREFIX,
        "STATE_PREFIX": natsio.STATE_PREFIX,
        "LIVE_PREFIX": natsio.LIVE_PREFIX,
    }
    try:
        found["build_events_subject"] = natsio.build_events_subject(SAMPLE_BUILD, SAMPLE_NODE)  # type: ignore[call-arg]
    except TypeError:  # before build events named their sender
        found["build_events_subject"] = natsio.build_events_subject(SAMPLE_BUILD)
    optional = {
        "shared.applogs": ("APP_LOGS_SUBJECT_PREFIX",),
        "shared.secrets": ("ROTATE_SUBJECT",),
        "shared.watches": ("WATCH_OPEN_SUBJECT",),
        "shared.certs": ("CHANGED_SUBJECT", "KEYS_OPEN_SUBJECT"),
        "shared.security.permissions": ("JOIN_SUBJECT", "JOIN_ISSUE_SUBJECT", "VIEW_OPEN_SUBJECT"),
    }
    import importlib

    for module_name, names in optional.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            if hasattr(module, name):
                found[f"{module_name}.{name}"] = getattr(module, name)
    try:
        from shared.secrets import open_subject

        found["shared.secrets.open_subject"] = open_subject(SAMPLE_NODE)
    except ImportError:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nats", help="a cluster the release initialised")
    parser.add_argument("--out", type=Path, help="where its streams go (JSON)")
    parser.add_argument("--subjects", type=Path, help="where the release's subjects go (JSON)")
    args = parser.parse_args()
    if args.nats and args.out:
        args.out.write_text(json.dumps(asyncio.run(streams(args.nats)), indent=1, sort_keys=True) + "\n")
    if args.subjects:
        args.subjects.write_text(json.dumps(subjects(), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
