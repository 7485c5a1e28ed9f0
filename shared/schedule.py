"""Cron schedules as robfig/cron's ``ParseStandard`` reads them (what operators know from Go tools): 5-field
cron in UTC,
``CRON_TZ=``/``TZ=`` prefixes, descriptors (``@daily``…) and ``@every <Go duration>``. Used by volume
snapshot policies, cron jobs and the CLI's validation of both."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterBadDateError, CroniterError

from shared.errors import ZatteraError

NO_SLOT_WITHIN_YEARS = 5


class ScheduleError(ZatteraError, ValueError):
    pass


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_go_duration(text: str) -> float:
    """A Go ``time.ParseDuration`` string (e.g. ``1h30m``, ``90s``) in seconds."""
    pos, total = 0, 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None:
            raise ScheduleError(f"bad duration {text!r}")
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not text:
        raise ScheduleError("empty duration")
    return total


@dataclass(frozen=True, slots=True)
class Schedule:
    cron: str
    zone: tzinfo
    every: float = 0.0  # @every interval in whole seconds; 0 = cron

    def next_after(self, ts: float) -> float | None:
        """The first slot strictly after ``ts`` (second resolution); None when none within 5 years."""
        if self.every:
            return float(int(ts) + int(self.every))
        start = datetime.fromtimestamp(int(ts), self.zone)
        try:
            slot: datetime = croniter(self.cron, start, max_years_between_matches=NO_SLOT_WITHIN_YEARS).get_next(
                datetime
            )
        except CroniterBadDateError:
            return None
        return slot.timestamp()


@functools.lru_cache(maxsize=4096)
def parse_schedule(text: str) -> Schedule:
    """Parse a policy schedule the way robfig/cron ``ParseStandard`` does."""
    spec = text.strip()
    zone: tzinfo = UTC
    if spec.startswith(("CRON_TZ=", "TZ=")):
        head, _, spec = spec.partition(" ")
        name = head.split("=", 1)[1]
        try:
            zone = ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ScheduleError(f"unknown time zone {name!r}") from exc
        spec = spec.strip()
    if spec.startswith("@every"):
        seconds = parse_go_duration(spec[len("@every") :].strip())
        return Schedule("", zone, every=float(max(1, int(seconds))))
    if spec.startswith("@"):
        if spec not in ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"):
            raise ScheduleError(f"unknown descriptor {spec!r}")
    elif len(spec.split()) != 5:
        raise ScheduleError(f"expected exactly 5 fields (minute hour dom month dow), got {spec!r}")
    try:
        croniter(spec, datetime(2000, 1, 1, tzinfo=zone))
    except (CroniterError, ValueError, KeyError) as exc:
        raise ScheduleError(f"bad cron expression {spec!r}: {exc}") from exc
    return Schedule(spec, zone)


def validate_schedule(value: str) -> str:
    """A snapshot schedule as the snapshot scheduler reads it ("" = manual only); :class:`ScheduleError`
    (a ``ValueError``) if it never could."""
    text = value.strip()
    if text:
        parse_schedule(text)
    return text
