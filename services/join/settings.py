"""The join service's settings on a server machine (environment, prefix ``ZATTERA_MACHINE_``): set by
``zattera up`` (cli/machine.py), they say which machine this is and where other machines reach it."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class MachineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_MACHINE_", extra="ignore", use_attribute_docstrings=True)

    node: str = ""
    """This machine's node id; '' = not a machine of a multi-machine cluster."""
    client_url: str = ""
    """Where other machines reach this machine's NATS server (comma-separated URLs)."""
    route_url: str = ""
    """The cluster route URLs of this machine's NATS servers (comma-separated)."""
    mesh_ip: str = ""
    """This machine's address on the private WireGuard mesh."""
    server_names: str = ""
    """This machine's NATS servers' names, comma-separated (the first machine: its three seats)."""
