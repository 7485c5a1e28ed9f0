"""An environment's configuration: plain variables and secret references on its ``ServiceSpec``.

The env's ``service`` holds the staged configuration (``vars``, ``secrets`` name → sealed version,
``config_version``); a release freezes a copy, so a rollback runs the old values again. The rules every
writer applies (the CLI's ``config``/``secrets`` commands, ``zattera apps apply``) live here, each error
naming the field it is about. Values of secrets are never seen here: only their sealed sizes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from zattera.v1 import types_pb2 as pb

from shared.actions.refusals import Invalid

MAX_VALUE_BYTES = 64 * 1024
"""One variable's or secret's value, UTF-8 encoded."""
MAX_ENV_BYTES = 1024 * 1024
"""Every name and value of an environment's variables and secrets together."""
SEALED_OVERHEAD = 48
"""What NaCl's SealedBox adds to a plaintext (ephemeral public key + MAC): value size = ciphertext - 48."""

_POSIX_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_NAME = 256
RESERVED_NAMES = frozenset({"PORT"})
RESERVED_PREFIXES = ("PORT_", "ZATTERA_")


class ConfigError(Invalid):
    """A refused configuration change; ``field`` is what it is about (``vars.FOO``, ``secrets.BAR``…)."""


def check_name(field: str, name: str) -> None:
    """A variable or secret name: a POSIX environment name the platform does not set itself."""
    if not _POSIX_NAME.match(name) or len(name) > _MAX_NAME:
        raise ConfigError(
            field, f"{name!r} is not a POSIX environment variable name (letters, digits, '_'; not a digit first)"
        )
    upper = name.upper()
    if upper in RESERVED_NAMES or upper.startswith(RESERVED_PREFIXES):
        raise ConfigError(field, f"{name!r} is reserved: the platform sets PORT, PORT_* and ZATTERA_*")


def check_value_size(field: str, size: int) -> None:
    if size > MAX_VALUE_BYTES:
        raise ConfigError(field, f"the value is {size:,} bytes; at most {MAX_VALUE_BYTES:,} (64 KiB)")


def check_var(name: str, value: str) -> None:
    field = f"vars.{name}"
    check_name(field, name)
    if "\x00" in value:
        raise ConfigError(field, "the value contains a NUL byte")
    check_value_size(field, len(value.encode()))


def parse_assignments(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` arguments → mapping, each checked; an item without ``=`` names itself."""
    parsed: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(name or item, "expected KEY=VALUE")
        check_var(name, value)
        parsed[name] = value
    return parsed


def secret_sizes(service: pb.ServiceSpec, sealed: Iterable[pb.SealedSecret]) -> dict[str, int]:
    """The plaintext size of each secret ``service`` references, from its sealed version's length."""
    by_id = {s.meta.id: s for s in sealed}
    sizes = {}
    for name, ref in service.secrets.items():
        record = by_id.get(ref.secret_id)
        sizes[name] = max(0, len(record.ciphertext) - SEALED_OVERHEAD) if record is not None else 0
    return sizes


def env_size(vars: Mapping[str, str], secrets: Mapping[str, int]) -> int:
    """Bytes of every name and value (``secrets``: name → value size)."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in vars.items()) + sum(
        len(k.encode()) + size for k, size in secrets.items()
    )


def check_env_size(vars: Mapping[str, str], secrets: Mapping[str, int], field: str = "env") -> None:
    total = env_size(vars, secrets)
    if total > MAX_ENV_BYTES:
        raise ConfigError(
            field, f"variables and secrets would take {total:,} bytes in all; at most {MAX_ENV_BYTES:,} (1 MiB)"
        )


def with_vars(service: pb.ServiceSpec, vars: Mapping[str, str]) -> bool:
    """Make ``service.vars`` exactly ``vars``; True if that changed anything (config_version bumped)."""
    if dict(service.vars) == dict(vars):
        return False
    service.vars.clear()
    service.vars.update(vars)
    service.config_version += 1
    return True


def unreferenced_secrets(
    sealed: Iterable[pb.SealedSecret], env: pb.Environment, releases: Iterable[pb.Release]
) -> list[str]:
    """Ids of sealed versions neither the env's staged spec nor any of its releases use (safe to delete:
    a rollback can only go to a release that still exists)."""
    used = {ref.secret_id for ref in env.service.secrets.values()}
    for release in releases:
        used.update(ref.secret_id for ref in release.service.secrets.values())
    return [s.meta.id for s in sealed if s.meta.id not in used]


def check_secret_value(name: str, value: bytes) -> str:
    """A secret's value as the process will see it (UTF-8 text without NUL); errors never quote it."""
    field = f"secrets.{name}"
    if not value:
        raise ConfigError(field, "the value is empty (give it on stdin, at the prompt or with --from-file)")
    check_value_size(field, len(value))
    try:
        text = value.decode()
    except UnicodeDecodeError:
        raise ConfigError(field, "the value is not UTF-8 text") from None
    if "\x00" in text:
        raise ConfigError(field, "the value contains a NUL byte")
    return text
