"""The local node of ``zattera up``: the agent and the ingress proxy it supervises beside the control plane,
their arguments, and their environment (their own directory and credential, nothing of the control
plane's). The cluster they belong to is :class:`cli.up_cluster.Cluster`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cli.layout import NATS_CA
from cli.supervised import PROJECT_ROOT, Supervised, port_free
from cli.up_cluster import CONTROL_ONLY_SETTINGS
from services.proxy.launch import split_listen
from shared.embedded import free_port
from shared.runtime_note import RUNTIME_NOTE

if TYPE_CHECKING:
    from cli.up_cluster import Cluster


def node_processes(cluster: Cluster, env: dict[str, str]) -> list[Supervised]:
    """The local node: an agent (docker runtime when a Docker daemon answers, else processes; the builder)
    and the ingress proxy."""
    found = []
    root = PROJECT_ROOT / "services"
    # The proxy's ports first: the agent lets apps connect to them (every other port this process tree
    # listens on is fenced from apps: services/agent/firewall.py).
    port = cluster.proxy_port if port_free(cluster.proxy_port) else free_port()
    cluster.proxy_port = port
    public = [port]
    if cluster.proxy_tls_listen:
        tls_host, tls_port = split_listen(cluster.proxy_tls_listen)
        tls_port = tls_port if tls_port and port_free(tls_port) else free_port()
        cluster.proxy_tls_listen = f"[{tls_host}]:{tls_port}" if ":" in tls_host else f"{tls_host}:{tls_port}"
        public.append(tls_port)
    if (root / "agent" / "__main__.py").exists():
        (cluster.agent_data_dir / RUNTIME_NOTE).unlink(missing_ok=True)  # the one this start writes, not a stale one
        agent = Supervised(
            "agent",
            [
                sys.executable,
                "-m",
                "services.agent",
                "--nats",
                cluster.url,
                "--node-id",
                cluster.node_id,
                "--data-dir",
                str(cluster.agent_data_dir),
                "--builder",
                "--roles",
                "worker,control",
                # Ctrl-C leaves no process behind: the app instances stop with the agent, and the next
                # `zattera up` starts them again from the same desired state.
                "--stop-on-exit",
                *cluster.machine.get("agent_args", []),
                *cluster.metrics_args("agent"),
            ],
            cluster.layout.logs / "agent.log",
            {
                **node_env(cluster, env, "agent", cluster.agent_data_dir),
                # Should an app's directory contain the data dir: every sandbox shows it empty.
                "ZATTERA_AGENT_SANDBOX_HIDDEN": str(cluster.data_dir),
                # Apps cannot connect to what this process tree listens on but the proxy's ports.
                "ZATTERA_AGENT_SANDBOX_FENCE_PIDS": str(os.getpid()),
                "ZATTERA_AGENT_SANDBOX_FENCE_ALLOW": ",".join(map(str, public)),
                # ... from the start for the ports known now (the console may not listen yet).
                "ZATTERA_AGENT_SANDBOX_FENCE_PORTS": ",".join(map(str, cluster.known_control_ports())),
            },
        )
        cluster.launch(agent)
        found.append(agent)
    if (root / "proxy" / "__main__.py").exists():
        proxy = Supervised(
            "proxy",
            [
                sys.executable,
                "-m",
                "services.proxy",
                "--nats",
                cluster.url,
                "--host",
                cluster.proxy_host,
                "--port",
                str(port),
                "--node-id",
                cluster.node_id,
                "--proxy-id",
                cluster.node_id,
                "--cache-dir",
                str(cluster.layout.proxy),
                *(["--tls-listen", cluster.proxy_tls_listen] if cluster.proxy_tls_listen else []),
                *cluster.metrics_args("proxy"),
            ],
            cluster.layout.logs / "proxy.log",
            node_env(cluster, env, "proxy", cluster.layout.proxy),
        )
        cluster.launch(proxy)
        found.append(proxy)
    return found


def node_env(cluster: Cluster, env: dict[str, str], name: str, directory: Path) -> dict[str, str]:
    """The local agent's or proxy's environment: its own directory, credential and CA copy, nothing that
    points into the control plane's directory."""
    own = {
        k: v
        for k, v in env.items()
        if k not in ("ZATTERA_NATS_CREDS", "ZATTERA_NATS_TLS_CA") and not k.startswith(CONTROL_ONLY_SETTINGS)
    }
    own["ZATTERA_DATA_DIR"] = str(directory)
    if cluster.node_creds.get(name):
        own["ZATTERA_NATS_CREDS"] = cluster.node_creds[name]
    if cluster.tls_ca:
        copy = directory / NATS_CA
        directory.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(Path(cluster.tls_ca).read_bytes())  # a certificate: public, but the node's own copy
        own["ZATTERA_NATS_TLS_CA"] = str(copy)
    return own
