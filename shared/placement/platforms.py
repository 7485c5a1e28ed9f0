"""OCI platform strings ("os/arch") and the matching rule placement uses.

Aliases and case are normalised on both sides, so a release built for ``linux/x86_64`` runs on a node
reporting ``Linux/AMD64``. A string that does not normalise is compared lowercased and trimmed (a
"loose" match), which is why a node with an empty ``os_arch`` only matches an unconstrained
release.
"""

from __future__ import annotations

import platform as _host
from collections.abc import Iterable
from functools import lru_cache

from shared.errors import ZatteraError

KNOWN_OS = frozenset({"linux", "darwin", "windows", "freebsd"})
KNOWN_ARCH = frozenset({"amd64", "arm64", "arm", "386", "riscv64", "ppc64le", "s390x"})
ARCH_ALIASES = {
    "x86_64": "amd64",
    "x86-64": "amd64",
    "aarch64": "arm64",
    "arm64/v8": "arm64",
    "armv7l": "arm",
    "arm/v7": "arm",
}


class PlatformError(ZatteraError, ValueError):
    pass


def normalize_platform(value: str) -> str:
    """Canonical "os/arch" (aliases mapped, lowercase), or :class:`PlatformError`."""
    text = value.strip().lower()
    os_name, sep, arch = text.partition("/")
    if not sep or not os_name or not arch:
        raise PlatformError(f'platform {value!r} is not an os/arch pair (e.g. "linux/amd64")')
    arch = ARCH_ALIASES.get(arch, arch)
    if os_name not in KNOWN_OS:
        raise PlatformError(f'unknown os "{os_name}" in "{value}"')
    if arch not in KNOWN_ARCH:
        raise PlatformError(f'unknown arch "{arch}" in "{value}"')
    return f"{os_name}/{arch}"


@lru_cache(maxsize=1024)
def loose_platform(value: str) -> str:
    """The normalised form when there is one, else the lowercased, trimmed text."""
    try:
        return normalize_platform(value)
    except PlatformError:
        return value.strip().lower()


def platform_set(platforms: Iterable[str]) -> frozenset[str]:
    """The loose forms of a release's platforms (empty = unconstrained)."""
    return frozenset(loose_platform(p) for p in platforms)


def supports(node_os_arch: str, platforms: Iterable[str]) -> bool:
    """True when a node of ``node_os_arch`` can run an image built for ``platforms`` (empty = any node)."""
    wanted = platform_set(platforms)
    return not wanted or loose_platform(node_os_arch) in wanted


def local_platform() -> str:
    """The platform of this process's host, normalised."""
    return normalize_platform(f"{_host.system()}/{_host.machine()}")
