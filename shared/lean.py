"""Loading what a long-running process needs and no more (PERFORMANCE.md "CLI start-up" and "A lighter node"):
nats-py without aiohttp and importlib.metadata, which it loads only for its websocket transport and its
version. The CLI (``cli/startup.py``) and the node's processes (the agent, the proxy) import nats-py through
:func:`import_nats` before anything else loads it; the node's processes :func:`settle` once started."""

from __future__ import annotations

import gc
import os
import sys


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


SETTLE_AFTER = 2.0
"""Seconds after a node process started its work before :func:`settle` runs (its start-up garbage is gone)."""


def settle() -> None:
    """Once a long-running process has started: collect the start-up garbage, move what lives on out of the
    cyclic collector's sight (:func:`gc.freeze`: later collections no longer walk the modules and the
    start-up state), and hand the C heap's free pages back to the system (glibc's ``malloc_trim``: imports
    free much of what they allocate, which the heap otherwise keeps resident)."""
    gc.collect()
    gc.freeze()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim that way
        pass


def settle_soon(delay: float = SETTLE_AFTER) -> None:
    """:func:`settle` ``delay`` seconds from now, on the running event loop."""
    import asyncio  # loaded already by the processes that call this; not by the CLI, which imports this module

    asyncio.get_running_loop().call_later(delay, settle)
