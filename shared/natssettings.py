"""Where a process connects: the NATS servers, its credential and the CA (``ZATTERA_NATS_URL``,
``ZATTERA_NATS_CREDS``, ``ZATTERA_NATS_TLS_CA``), and where the CLI keeps its saved contexts
(``ZATTERA_CONFIG_DIR``).

Read straight from the environment, apart from :mod:`shared.settings` (whose ``nats_*`` fields are these, with
the same names and defaults: ``tests/unit/test_settings_docs.py`` checks it), so that a command that only
connects and reads (``zattera status``) loads neither pydantic-settings nor every setting of the platform.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ENV_PREFIX = "ZATTERA_"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class NatsSettings:
    nats_url: str = DEFAULT_NATS_URL
    """The NATS server(s) to connect to, comma-separated for a cluster."""
    nats_creds: str = ""
    """NATS credentials file of this process; '' = no auth."""
    nats_tls_ca: str = ""
    """CA file the NATS server certificate must chain to; '' = plain connections."""

    @classmethod
    def from_environ(cls) -> NatsSettings:
        """The settings the environment gives (names case-insensitive, as pydantic-settings reads them)."""
        found = {name.upper(): value for name, value in os.environ.items()}
        return cls(
            nats_url=found.get(f"{ENV_PREFIX}NATS_URL", DEFAULT_NATS_URL),
            nats_creds=found.get(f"{ENV_PREFIX}NATS_CREDS", ""),
            nats_tls_ca=found.get(f"{ENV_PREFIX}NATS_TLS_CA", ""),
        )


@lru_cache(maxsize=1)
def nats_settings() -> NatsSettings:
    return NatsSettings.from_environ()


def config_dir() -> Path:
    """Where the CLI keeps its contexts (``contexts.json``): ``ZATTERA_CONFIG_DIR``, else
    ``$XDG_CONFIG_HOME/zattera``, else ``~/.config/zattera``; read afresh (a command may change them)."""
    found = {name.upper(): value for name, value in os.environ.items()}
    explicit = found.get(f"{ENV_PREFIX}CONFIG_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "zattera"
