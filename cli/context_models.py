"""The models of the contexts file (:mod:`cli.contexts`): a saved connection and the file holding them."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator


class Context(BaseModel):
    nats: str = Field(description="NATS URL(s), comma-separated")
    creds: str = Field(default="", description="NATS credentials file")
    tls_ca: str = Field(default="", description="CA file the NATS server certificate must chain to")

    @field_validator("nats")
    @classmethod
    def _urls(cls, value: str) -> str:
        urls = [u.strip() for u in value.split(",") if u.strip()]
        if not urls:
            raise ValueError("at least one URL")
        for url in urls:
            if "://" not in url:
                raise ValueError(f"{url!r} is not a URL (nats://host:port)")
        return ",".join(urls)


class ContextFile(BaseModel):
    current: str = ""
    contexts: dict[str, Context] = Field(default_factory=dict)
