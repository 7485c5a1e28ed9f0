"""What ``zattera status`` and the console say about notification channels that fail (docs/notifications.md)."""

from __future__ import annotations

import datetime

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.state.reader import StateReader


def failing_channels(view: StateReader) -> list[str]:
    """One line per FAILING channel, by name (empty: every channel delivers)."""
    lines = []
    for status in sorted(view.all(K.NOTIFY_STATUS), key=lambda s: s.meta.id):
        if not isinstance(status, pb.NotifyStatus) or not status.failing:
            continue
        since = datetime.datetime.fromtimestamp(status.failing_since.seconds, datetime.UTC).strftime(
            "%Y-%m-%d %H:%M:%S"
        )
        lines.append(
            f"notifications: channel {status.meta.id} FAILING since {since} UTC "
            f"({status.failures} attempt(s) in a row): {status.last_error}"
        )
    return lines
