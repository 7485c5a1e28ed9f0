"""Entry point: `python -m services.certs [--nats URL]`.

The certificate loop runs in the holder of ``lease.certs``; it follows route snapshots for the hostnames
that want TLS (``RouteSnapshot.cert_hosts``) besides the ``Domain`` records, and a snapshot that routes a new
name wakes it at once.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from services.certs.issuer import AcmeIssuer
from services.certs.localca import LocalCAFile
from services.certs.loop import CertificateLoop, RoutedHosts
from services.certs.settings import CertsSettings
from shared import localca
from shared.routeclient import RouteClient
from shared.service import ServiceContext, main


async def build(ctx: ServiceContext) -> Sequence[Coroutine[Any, Any, None]]:
    cfg = CertsSettings()
    acme = (
        AcmeIssuer(cfg.acme_directory, cfg.acme_email, ca_bundle=cfg.acme_ca_bundle, order_timeout=cfg.order_timeout)
        if cfg.acme_directory
        else None
    )
    local_ca = LocalCAFile(localca.directory(ctx.settings.data_dir)) if cfg.local_ca else None
    routes = RouteClient(ctx.settings.data_dir / "certs" / "routes.cache")
    routed = RoutedHosts()
    updates = routes.updates()  # before start: no snapshot can come between the two
    await routes.start(ctx.conn)
    loop = CertificateLoop(ctx.loop_deps, tick=ctx.settings.loop_tick, acme=acme, local_ca=local_ca, routed=routed)

    async def follow_routes() -> None:
        try:
            async for snapshot in updates:
                routed.update(snapshot.cert_hosts)
        finally:
            updates.close()
            await routes.stop()

    return [ctx.lead(loop), follow_routes()]


if __name__ == "__main__":
    main("certs", build)
