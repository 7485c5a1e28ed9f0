"""The defaults of the settings the state plumbing also takes as parameters (batch size, delete-marker and
live-sample lifetimes, lease timing), importable without pydantic-settings: a command that only connects
and reads (``zattera status``) loads the plumbing, not the settings. :mod:`shared.settings` fields default
to these, so each value is written once."""

from __future__ import annotations

MAX_BATCH = 1000
"""Messages per atomic batch (one fenced write); ``ZATTERA_MAX_BATCH``."""
TOMBSTONE_TTL = 900.0
"""Seconds a delete marker stays in the state stream; ``ZATTERA_TOMBSTONE_TTL``."""
LIVE_TTL = 60.0
"""Seconds a live sample (heartbeat, proxy demand) is kept in zattera-live; ``ZATTERA_LIVE_TTL``."""
LEASE_TTL = 3.0
"""Seconds after its last renewal a leader lease expires; ``ZATTERA_LEASE_TTL``."""
LEASE_RENEW = 1.0
"""Seconds between a leader's lease renewals; ``ZATTERA_LEASE_RENEW``."""
LEASE_PROBE = 0.5
"""Seconds between a standby's looks at a lease held by a holder that answers probes; ``ZATTERA_LEASE_PROBE``."""
