"""The CLI drops asyncio's TLS half-close notice (printed above every answer on a TLS cluster) and nothing else."""

from __future__ import annotations

import logging
import subprocess
import sys

from cli.lognotices import TLS_EOF_NOTICE


def test_the_tls_eof_notice_is_dropped_and_other_asyncio_warnings_are_not() -> None:
    script = (
        "import logging\n"
        "from cli.lognotices import quiet_asyncio_tls_notice\n"
        "quiet_asyncio_tls_notice()\n"
        "log = logging.getLogger('asyncio')\n"
        f"log.warning('returning true from {TLS_EOF_NOTICE}')\n"
        "log.warning('Task was destroyed but it is pending!')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert TLS_EOF_NOTICE not in done.stderr
    assert "Task was destroyed but it is pending!" in done.stderr


def test_the_notice_is_asyncios_own_wording() -> None:
    """If asyncio rewords its notice the filter silently stops working: pin the text it logs."""
    import asyncio.log
    import asyncio.sslproto
    import inspect

    source = inspect.getsource(asyncio.sslproto)
    assert "'returning true from eof_received() '" in source and "'has no effect when using ssl'" in source
    assert logging.getLogger("asyncio") is asyncio.log.logger
