"""Entry point: ``python -m cli.control_plane [--nats URL]``: the whole control plane in one process.

Each service's own ``build`` runs here unchanged, with a context of its own (its name, its lease holder):
the same loops under the same leases, the same fenced writes, as when each runs as
``python -m services.<name>``. They share one NATS connection and one state view, which the loops of a
single service already share; a second replica of any service (all-in-one or not) splits the leases with
this one as usual. One interpreter instead of six is what brings a single machine's control plane from
six Python processes to one (PERFORMANCE.md, "Footprint").

It composes the services, so it lives with the other composition of them (``zattera up``) in ``cli/``, not
under ``services/``, whose packages never import each other (tests/unit/test_service_imports.py).
"""

from __future__ import annotations

import asyncio
import sys

from services.autoscale.__main__ import build as autoscale
from services.builds.__main__ import build as builds
from services.certs.__main__ import build as certs
from services.console.__main__ import build as console
from services.join.__main__ import build as join
from services.orchestrator.__main__ import build as orchestrator
from services.routes.__main__ import build as routes
from services.scheduler.__main__ import build as scheduler
from services.secrets.__main__ import build as secrets
from shared.service import Build, serve_all

NAME = "allinone"
BUILDS: dict[str, Build] = {
    "scheduler": scheduler,
    "orchestrator": orchestrator,
    "autoscale": autoscale,
    "builds": builds,
    "routes": routes,
    "secrets": secrets,
    "certs": certs,
    "console": console,
    "join": join,
}
"""The services it runs, by name (the name each one's leases and logs carry)."""


def main() -> None:
    sys.exit(asyncio.run(serve_all(NAME, BUILDS)))


if __name__ == "__main__":
    main()
