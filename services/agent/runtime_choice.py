"""Which runtime a node runs its instances on (processes or a Docker daemon's containers), chosen at start, and
the Docker daemon's address: kept apart from ``docker_runtime.py`` so that a node without a Docker daemon
never loads the Docker client (aiodocker, and aiohttp under it: ~11 MB resident, PERFORMANCE.md "A lighter
node"). ``docker_runtime.py`` is imported only when a daemon may answer."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.agent.launchers import DOCKER, PROCESS, Launcher, ProcessLauncher
from services.agent.settings import AgentSettings
from shared.errors import ZatteraError

if TYPE_CHECKING:
    from services.agent.docker_runtime import DockerLauncher

log = logging.getLogger(__name__)

DEFAULT_DOCKER_URL = "unix:///var/run/docker.sock"
PROCESS_FALLBACK = "apps run as processes, without containers' memory and CPU limits"
"""What falling back to the process runtime costs (how apps are isolated there is said apart: ``Isolation``)."""


class DockerUnavailable(ZatteraError):
    """No Docker daemon answers at the configured address."""


def docker_url(host: str) -> str:
    """The daemon address aiodocker takes: ``unix:///path`` or ``tcp://…`` (default: the standard socket;
    ``AgentSettings.docker_host`` reads ``DOCKER_HOST``)."""
    return host or DEFAULT_DOCKER_URL


def no_daemon_socket(host: str) -> bool:
    """Whether ``host`` is a unix socket path with nothing there: no daemon can answer, known without asking
    (a ``tcp://`` address, or a socket that exists, has to be asked)."""
    url = docker_url(host)
    return url.startswith("unix://") and not os.path.exists(url.removeprefix("unix://"))


@dataclass(frozen=True)
class RuntimeChoice:
    """The node's runtime and why (``zattera up`` prints it; the node record carries it)."""

    launcher: Launcher
    reason: str


async def choose_launcher(settings: AgentSettings) -> RuntimeChoice:
    """The node's runtime: as ``settings.runtime`` says; unset, docker when a daemon answers (the agent makes
    the base image when the daemon lacks it), else processes with a warning (processes get no memory or CPU
    limits; the sandbox, ``sandbox.py``, isolates them where the machine allows)."""
    process = ProcessLauncher(adopted_poll_interval=settings.adopted_poll_interval)
    if settings.runtime == PROCESS:
        return RuntimeChoice(process, "chosen by --runtime process (ZATTERA_AGENT_RUNTIME)")
    url = docker_url(settings.docker_host)
    answers = False
    if not no_daemon_socket(settings.docker_host):
        from services.agent.docker_runtime import daemon_answers

        answers = await daemon_answers(settings.docker_host)
    if not answers and settings.runtime == DOCKER:
        raise DockerUnavailable(f"runtime docker: no Docker daemon answers at {url}")
    if not answers:
        why = f"no Docker daemon answers at {url}: {PROCESS_FALLBACK}{daemon_hint(settings.docker_host)}"
        log.warning("%s (install Docker, or --runtime to choose)", why)
        return RuntimeChoice(process, why)
    from services.agent.docker_runtime import docker_choice

    return await docker_choice(settings)


def daemon_hint(host: str) -> str:
    """How to get containers when Docker is installed here but its daemon is not running at the standard socket."""
    if host or shutil.which("dockerd") is None:
        return ""
    return " (Docker is installed but its daemon is not running: `systemctl start docker`, then restart this agent)"


def docker_launcher(launcher: Launcher) -> DockerLauncher | None:
    """``launcher`` when it is a Docker daemon's (``docker_runtime.py``, loaded only on such a node), else None."""
    if launcher.name != DOCKER:
        return None
    from services.agent.docker_runtime import DockerLauncher

    return launcher if isinstance(launcher, DockerLauncher) else None
