"""An add-on database as an environment (docs/addons.md): app ``NAME`` of its project, env ``db``, stateful,
volumes ``data`` and ``backups``, one port, a health check by a real query, and the entry script of its
engine in a plain variable (``ZATTERA_ADDON_ENTRY``: no secret in it) that the instance's command writes
into its directory and runs, so a process listing shows ``sh zattera-addon.sh``, never a password.

The add-on is recognised by its variable ``ZATTERA_ADDON`` (``postgres:15``, ``redis:7``); no new record
kind: the database is its env, its passwords are the env's sealed secrets, its backups are in its volume
``backups`` (pgBackRest's repository for PostgreSQL).
"""

from __future__ import annotations

import re
import secrets as random
from dataclasses import dataclass
from importlib import resources
from urllib.parse import quote

from zattera.v1 import types_pb2 as pb

from shared.errors import ZatteraError

ADDON_VAR = "ZATTERA_ADDON"
"""``<engine>:<version>`` on an add-on's env."""
ENTRY_VAR = "ZATTERA_ADDON_ENTRY"
ENV_NAME = "db"
"""The env of an add-on's app: the database's private name is ``NAME.db.PROJECT.internal``."""
DATA_VOLUME = "data"
BACKUPS_VOLUME = "backups"

POSTGRES = "postgres"
REDIS = "redis"
ENGINES: dict[str, tuple[str, ...]] = {POSTGRES: ("15",), REDIS: ("7",)}
"""Engine → the versions this node's packages provide (the Makefile's SYSTEM_PACKAGES); the first is the
default."""
PORTS = {POSTGRES: 5432, REDIS: 6379}

# Secrets of an add-on env (sealed; never logged): the server's passwords and the URL handed to attached envs.
SUPERUSER_PASSWORD = "POSTGRES_PASSWORD"
APP_PASSWORD = "APP_PASSWORD"
REDIS_PASSWORD = "REDIS_PASSWORD"
URL_SECRET = "ZATTERA_ADDON_URL"
"""The connection URL attached envs get (as ``DATABASE_URL``/``REDIS_URL``), with the address left as a
reference the consumer's agent fills in (``${ZATTERA_SERVICE_<APP>_DB_HOST}``: each consumer reaches the
database at an address of its own, docs/networking.md)."""

APP_USER = "app"
APP_DB = "app"
ARCHIVE_TIMEOUT = 60
"""Seconds: PostgreSQL switches to a new WAL segment (archived at once) at least this often when there
were writes, which bounds the RPO."""
BACKUP_INTERVAL = 86400
"""Seconds between full base backups."""

NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$|^[a-z]$")
ENTRY_COMMAND = 'printf "%s\\n" "$ZATTERA_ADDON_ENTRY" > zattera-addon.sh && exec sh zattera-addon.sh'
IMAGE_REF = "exec:sh%20zattera-addon.sh"
"""The release's image: an empty directory of the instance (the command writes the script into it)."""


class AddonInputError(ZatteraError, ValueError):
    """A bad field of an add-on request: ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def check_engine(engine: str, version: str) -> str:
    """The version to run (``""`` = the engine's default), or :class:`AddonInputError`."""
    if engine not in ENGINES:
        raise AddonInputError("engine", f"unknown engine {engine!r}: one of {', '.join(sorted(ENGINES))}")
    versions = ENGINES[engine]
    if not version:
        return versions[0]
    if version not in versions:
        raise AddonInputError("version", f"{engine} {version} is not available: {', '.join(versions)}")
    return version


def check_name(name: str, field: str = "name") -> str:
    if not NAME_RE.match(name):
        raise AddonInputError(field, f"{name!r} must be 1-40 lowercase letters, digits or '-', starting with a letter")
    return name


def new_password() -> str:
    """32 URL-safe characters (192 bits): nothing to escape in a URL or a SQL literal."""
    return random.token_urlsafe(24)


def env_token(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", text.upper())


def host_ref(app: str) -> str:
    return "${ZATTERA_SERVICE_" + env_token(app) + "_" + env_token(ENV_NAME) + "_HOST}"


def port_ref(app: str) -> str:
    return "${ZATTERA_SERVICE_" + env_token(app) + "_" + env_token(ENV_NAME) + "_PORT}"


def entry_script(engine: str) -> str:
    return resources.files("shared.addons").joinpath(f"{engine}_entry.sh").read_text()


def postgres_bin(version: str) -> str:
    return f"/usr/lib/postgresql/{version}/bin"


@dataclass(frozen=True, slots=True)
class Fork:
    """A point-in-time restore into a new database: the origin's repository (its ``backups`` volume's
    ``repo``, copied into the fork's own ``backups`` volume by the node's agent before the first start) and
    the target (``latest`` or a UTC time)."""

    origin_volume_id: str
    origin_stanza: str
    target: str
    from_snapshot: str = ""
    """Off-site: the snapshot of the origin's ``backups`` volume restored into the fork's own ``backups``
    volume before its env was written (``origin_volume_id`` is then "": nothing to copy on the node)."""


FORK_VOLUME_VAR = "ZATTERA_ADDON_RESTORE_VOLUME"
"""On a fork: the origin's ``backups`` volume id, which the node's agent copies (its ``repo``) into the
fork's ``backups`` volume as ``origin-repo`` before the first start (services/agent/addon_env.py)."""
ORIGIN_REPO_DIR = "origin-repo"
FORK_SNAPSHOT_VAR = "ZATTERA_ADDON_RESTORE_SNAPSHOT"
"""On a fork from off-site: the snapshot of the origin's ``backups`` volume its own ``backups`` volume was
restored from (its ``repo`` becomes ``origin-repo`` at the first start: postgres_entry.sh)."""


def database_url(engine: str, app: str, password: str) -> str:
    host = f"{host_ref(app)}:{port_ref(app)}"
    if engine == POSTGRES:
        return f"postgresql://{APP_USER}:{quote(password, safe='')}@{host}/{APP_DB}"
    return f"redis://default:{quote(password, safe='')}@{host}/0"


def consumer_vars(engine: str, app: str) -> dict[str, str]:
    """The plain variables an attached env gets beside its sealed ``DATABASE_URL``/``PGPASSWORD``."""
    if engine == POSTGRES:
        return {"PGHOST": host_ref(app), "PGPORT": port_ref(app), "PGUSER": APP_USER, "PGDATABASE": APP_DB}
    return {}


def url_name(engine: str) -> str:
    return "DATABASE_URL" if engine == POSTGRES else "REDIS_URL"


def attached_var(app: str) -> str:
    """The consumer's marker of an attachment (its value: the add-on env's id)."""
    return f"ZATTERA_ADDON_ATTACHED_{env_token(app)}"


def service_spec(
    engine: str,
    version: str,
    stanza: str,
    *,
    fork: Fork | None = None,
    archive_timeout: int = ARCHIVE_TIMEOUT,
    backup_interval: int = BACKUP_INTERVAL,
) -> pb.ServiceSpec:
    """The stateful service of an add-on (secrets are added by the caller, sealed)."""
    spec = pb.ServiceSpec(stateful=True, command=ENTRY_COMMAND)
    spec.replicas.min = spec.replicas.max = 1
    spec.volumes.add(volume_name=DATA_VOLUME, mount_path=f"/volumes/{DATA_VOLUME}")
    if engine == POSTGRES:
        spec.volumes.add(volume_name=BACKUPS_VOLUME, mount_path=f"/volumes/{BACKUPS_VOLUME}")
    spec.ports.add(name=engine, container_port=PORTS[engine], protocol=pb.PROTOCOL_TCP)
    spec.stop_grace.FromSeconds(60)
    hc = spec.healthcheck
    hc.type = pb.HEALTH_CHECK_TYPE_EXEC
    hc.interval.FromSeconds(5)
    hc.timeout.FromSeconds(4)
    hc.grace_period.FromSeconds(600)
    vars = {ADDON_VAR: f"{engine}:{version}", ENTRY_VAR: entry_script(engine)}
    if engine == POSTGRES:
        bin_dir = postgres_bin(version)
        # A real query, through the database's own socket (no password: local connections of its user),
        # once the instance is ready (its base backup taken when it had none: the window is open).
        hc.command = (
            f'test -e "$ZATTERA_VOLUME_DATA/ready" && {bin_dir}/psql -X -h "$ZATTERA_VOLUME_DATA/run"'
            " -p \"$PORT_POSTGRES\" -U postgres -d postgres -Atc 'select 1' | grep -qx 1"
        )
        vars |= {
            "ZATTERA_PG_BIN": bin_dir,
            "ZATTERA_PG_STANZA": stanza,
            "ZATTERA_PG_ARCHIVE_TIMEOUT": str(archive_timeout),
            "ZATTERA_PG_BACKUP_INTERVAL": str(backup_interval),
            # how often the instance reports its backups and archiver to its log (`addons backups`)
            "ZATTERA_PG_REPORT_INTERVAL": str(min(60, max(10, archive_timeout))),
        }
        if fork is not None:
            vars |= {"ZATTERA_PG_RESTORE_STANZA": fork.origin_stanza, "ZATTERA_PG_RESTORE_TARGET": fork.target}
            if fork.origin_volume_id:
                vars[FORK_VOLUME_VAR] = fork.origin_volume_id
            if fork.from_snapshot:
                vars[FORK_SNAPSHOT_VAR] = fork.from_snapshot
    else:
        # PING through the server's socket (an adopted instance's check runs without its secrets: the
        # server's NOAUTH answer is an answer too); the password only ever in the environment.
        hc.command = (
            'REDISCLI_AUTH="${REDIS_PASSWORD:-}" redis-cli --no-auth-warning -s "$ZATTERA_VOLUME_DATA/run/redis.sock"'
            " ping 2>&1 | grep -qE '^(PONG|NOAUTH)'"
        )
    spec.vars.update(vars)
    return spec


def addon_of(env: pb.Environment) -> tuple[str, str] | None:
    """(engine, version) of an add-on env, else None."""
    value = env.service.vars.get(ADDON_VAR, "")
    engine, _, version = value.partition(":")
    return (engine, version) if engine in ENGINES else None


BGSAVE_HOOK = "sh zattera-bgsave.sh"
"""The snapshot pre-hook of a Redis add-on's ``data`` volume (the script redis_entry.sh writes there)."""


def platform_pre_hook(env: pb.Environment | None, volume: pb.Volume) -> str:
    """The pre-hook the platform runs before a snapshot of ``volume`` when its policy sets none: for a Redis
    add-on's ``data`` volume, a ``BGSAVE`` waited for (a consistent ``dump.rdb`` beside the AOF); else ""."""
    if env is None or volume.name != DATA_VOLUME or env.meta.id != volume.environment_id:
        return ""
    return BGSAVE_HOOK if (addon_of(env) or ("", ""))[0] == REDIS else ""


PLATFORM_SCHEDULE = "@hourly"
"""How often the volume holding what restores an add-on (PostgreSQL's ``backups``: pgBackRest's repository of
base backups and archived WAL; Redis's ``data``: its AOF and RDB) is copied into the cluster's object store when
its snapshot policy names no schedule, so losing the database's node never loses its backups."""


def platform_schedule(env: pb.Environment | None, volume: pb.Volume) -> str:
    """The snapshot schedule the platform applies to ``volume`` when its policy sets none (else "")."""
    if env is None or env.meta.id != volume.environment_id:
        return ""
    engine = (addon_of(env) or ("", ""))[0]
    if (engine, volume.name) in ((POSTGRES, BACKUPS_VOLUME), (REDIS, DATA_VOLUME)):
        return PLATFORM_SCHEDULE
    return ""
