"""What every ``zattera`` process does before its command runs, kept light (PERFORMANCE.md "CLI start-up"):
nats-py imported without the modules a CLI never uses, the cyclic garbage collector paused while modules
load, and the root options applied."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


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


def import_nats() -> None:
    """Import nats-py with aiohttp and importlib.metadata hidden. nats-py loads aiohttp only for its
    websocket transport, the largest import of a plain read: a ``ws://`` server URL still works, as
    :func:`shared.connection.connect` hands the transport aiohttp when it meets one. It loads
    importlib.metadata (and the email package) only to read its own version, which is read here from the
    name of its ``.dist-info`` directory instead (importlib.metadata when that is not found). A process that
    already loaded nats-py is left as it is; one that loaded aiohttp or importlib.metadata has them used."""
    if "nats" in sys.modules:
        return
    hidden = [name for name in ("aiohttp", "importlib.metadata") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError meanwhile
    try:
        import nats.aio.client
        import nats.aio.transport
    finally:
        for name in hidden:
            del sys.modules[name]
    if "importlib.metadata" in hidden:
        version = distribution_version(nats.__file__, "nats_py") or _metadata_version("nats-py")
        nats.aio.client.__version__ = version


def distribution_version(module_file: str | None, distribution: str) -> str:
    """The version of ``distribution`` as the ``<name>-<version>.dist-info`` directory beside its package
    (the package of ``module_file``) names it; "" when there is none."""
    if not module_file:
        return ""
    site = os.path.dirname(os.path.dirname(module_file))
    prefix = f"{distribution}-"
    try:
        names = os.listdir(site)
    except OSError:
        return ""
    for name in names:
        if name.startswith(prefix) and name.endswith(".dist-info"):
            return name.removeprefix(prefix).removesuffix(".dist-info")
    return ""


def _metadata_version(distribution: str) -> str:
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:  # nats-py's own fallback
        return "0.0.0"


def apply_root_options(nats_url: str) -> None:
    """What the root options do before any command: the NATS URL(s) to use, and tracing when an exporter
    is configured (unset: OpenTelemetry's SDK is not loaded)."""
    import_nats()
    from cli.client import OPTIONS

    OPTIONS.nats_url = nats_url
    if os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower() not in ("", "none"):
        from shared.telemetry import setup as setup_telemetry

        setup_telemetry("zattera-cli")
