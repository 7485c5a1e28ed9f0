"""Log records the CLI drops: notices of libraries that say nothing to an operator (with no logging
configured, Python's last-resort handler would print them above a command's answer)."""

from __future__ import annotations

import logging

TLS_EOF_NOTICE = "eof_received() has no effect when using ssl"
"""asyncio's notice when a TLS peer closes while nats-py's protocol asks to keep the transport half-open."""


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return TLS_EOF_NOTICE not in record.getMessage()


def quiet_asyncio_tls_notice() -> None:
    logging.getLogger("asyncio").addFilter(_DropNotices())
