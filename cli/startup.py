"""What every ``zattera`` process does before its command runs, kept light (PERFORMANCE.md "CLI start-up"):
nats-py imported without the modules a CLI never uses, the cyclic garbage collector paused while modules
load, and the root options applied."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

from shared.lean import import_nats as import_nats  # re-exported: cli/main.py and cli/app.py take it from here


@contextmanager
def paused_gc(*, freeze: bool = False) -> Iterator[None]:
    """The cyclic garbage collector off while modules load: an import creates many objects and frees almost
    none, so the collections it triggers find nothing to free (a few percent of a plain read). Put back as
    it was on the way out, whatever happened. ``freeze`` (the ``zattera`` process itself, never a test
    process that imports the CLI): what exists then, the loaded modules, is moved out of the collector's
    sight for good (:func:`gc.freeze`), so neither later collections nor the one at exit walk it again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def apply_root_options(nats_url: str) -> None:
    """What the root options do before any command: the NATS URL(s) to use, and tracing when an exporter
    is configured (unset: OpenTelemetry's SDK is not loaded)."""
    import_nats()
    from cli.client import OPTIONS

    OPTIONS.nats_url = nats_url
    if os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower() not in ("", "none"):
        from shared.telemetry import setup as setup_telemetry

        setup_telemetry("zattera-cli")
