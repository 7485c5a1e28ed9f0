"""Certificate service settings (environment, prefix ``ZATTERA_CERTS_``), beside the shared ``ZATTERA_*`` ones."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CertsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_CERTS_", extra="ignore", use_attribute_docstrings=True)

    acme_directory: str = ""
    """The ACME directory URL (Let's Encrypt, ZeroSSL, a private CA); empty: only *.localhost hosts."""
    acme_email: str = ""
    """The ACME account's contact e-mail."""
    acme_ca_bundle: str = ""
    """A PEM bundle to verify the directory's TLS with (a private CA); empty: the system's."""
    local_ca: bool = True
    """Issue *.localhost certificates from the cluster's local CA."""
    order_timeout: float = Field(default=45.0, gt=0)
    """Seconds an order may take to validate."""
