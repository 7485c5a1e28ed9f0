"""The encrypted mesh between nodes (docs/networking.md, "Several nodes"): one WireGuard interface per node.

The agent keeps a key pair (``<agent data>/wireguard.key``, 0600; the public half in ``Node.wireguard_public_key``)
and an interface ``zattera0`` holding the node's ``mesh_ip``/16, listening on UDP 51820 of the machine's
address (``Node.public_endpoints``). Every other node record with a key, a mesh address and an endpoint is a
peer (``allowed-ips`` = its ``mesh_ip``/32): app traffic between machines — the proxies and forwarders
connecting to replicas at ``<mesh_ip>:<port>`` — is encrypted on the wire. A node whose record goes is
removed as a peer; a node that is DOWN stays one (it comes back at the same address).

Kernel WireGuard when the kernel has it (``ip link add … type wireguard``), else the userspace
``wireguard-go`` (needs ``/dev/net/tun``); ``wg`` (wireguard-tools) configures both. Peers are applied with
``wg syncconf`` (only the difference changes: established sessions stay).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.errors import ZatteraError
from shared.security.creds import write_private
from shared.state.feed import StateView

log = logging.getLogger(__name__)

INTERFACE = "zattera0"
PORT = 51820
PREFIX = 16
KEEPALIVE = 25


class MeshError(ZatteraError):
    """The mesh interface could not be made (no WireGuard, no ``wg``, not root)."""


@dataclass(frozen=True, order=True)
class Peer:
    public_key: str
    mesh_ip: str
    endpoint: str


def load_or_create_key(path: Path) -> tuple[str, str]:
    """(private, public) base64 keys; the private one is made once and kept 0600."""
    if path.exists():
        private = PrivateKey(base64.b64decode(path.read_text().strip()))
    else:
        private = PrivateKey.generate()  # Curve25519, as WireGuard's keys (libsodium, already the agent's)
        write_private(path, base64.b64encode(bytes(private)).decode())
    return path.read_text().strip(), base64.b64encode(bytes(private.public_key)).decode()


def peers_of(nodes: list[pb.Node], self_id: str) -> list[Peer]:
    """Every other node that can be a peer (key, mesh address and endpoint known), in a stable order."""
    found = []
    for node in nodes:
        if node.meta.id == self_id or not node.wireguard_public_key or not node.mesh_ip or not node.public_endpoints:
            continue
        found.append(Peer(node.wireguard_public_key, node.mesh_ip, node.public_endpoints[0]))
    return sorted(found)


def peers_config(private_key: str, peers: list[Peer]) -> str:
    """The ``wg syncconf`` file: this interface's key and port, one ``[Peer]`` per node."""
    lines = ["[Interface]", f"PrivateKey = {private_key}", f"ListenPort = {PORT}", ""]
    for peer in peers:
        lines += [
            "[Peer]",
            f"PublicKey = {peer.public_key}",
            f"AllowedIPs = {peer.mesh_ip}/32",
            f"Endpoint = {peer.endpoint}",
            f"PersistentKeepalive = {KEEPALIVE}",
            "",
        ]
    return "\n".join(lines)


def available() -> str:
    """Why the mesh cannot run here ('' when it can)."""
    if os.geteuid() != 0:
        return "the agent is not root"
    if shutil.which("wg") is None:
        return "wg (wireguard-tools) is not installed"
    return ""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def ensure_interface(mesh_ip: str) -> str:
    """Make ``zattera0`` (kernel or wireguard-go) with ``mesh_ip``/16, up; returns which implementation."""
    kind = "kernel"
    if _ip("link", "show", INTERFACE).returncode != 0:
        if _ip("link", "add", INTERFACE, "type", "wireguard").returncode != 0:
            if shutil.which("wireguard-go") is None:
                raise MeshError("no kernel WireGuard and no wireguard-go (apt-get install wireguard-go)")
            done = subprocess.run(
                ["wireguard-go", INTERFACE], capture_output=True, text=True, check=False, env={**os.environ}
            )
            if done.returncode != 0:
                # Its error is on stdout ("UAPI listen error: …"); stderr holds a banner about kernel support.
                why = done.stdout.strip() or done.stderr.strip()
                raise MeshError(f"wireguard-go {INTERFACE} failed: {why}")
            kind = "wireguard-go"
    elif _ip("-d", "link", "show", INTERFACE).stdout.find("wireguard") < 0:
        kind = "wireguard-go"
    if f"{mesh_ip}/" not in _ip("-4", "addr", "show", "dev", INTERFACE).stdout:
        _ip("addr", "flush", "dev", INTERFACE)
        added = _ip("addr", "add", f"{mesh_ip}/{PREFIX}", "dev", INTERFACE)
        if added.returncode != 0:
            raise MeshError(f"cannot give {INTERFACE} {mesh_ip}: {added.stderr.strip()}")
    _ip("link", "set", INTERFACE, "up")
    return kind


def sync(config_path: Path, private_key: str, peers: list[Peer]) -> None:
    write_private(config_path, peers_config(private_key, peers))
    done = subprocess.run(["wg", "syncconf", INTERFACE, str(config_path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MeshError(f"wg syncconf {INTERFACE}: {done.stderr.strip()}")


class Mesh:
    """The node's side of the mesh: the interface, and its peers kept equal to the node records."""

    def __init__(self, data_dir: Path, node_id: str, mesh_ip: str) -> None:
        self.node_id = node_id
        self.mesh_ip = mesh_ip
        self.config_path = data_dir / "wireguard" / f"{INTERFACE}.conf"
        self.private_key, self.public_key = load_or_create_key(data_dir / "wireguard.key")
        self.kind = ""
        self.peers: list[Peer] = []

    def start(self) -> None:
        self.kind = ensure_interface(self.mesh_ip)
        sync(self.config_path, self.private_key, [])
        log.info("mesh: %s on %s (%s), UDP %d", INTERFACE, self.mesh_ip, self.kind, PORT)

    async def run(self, view: StateView) -> None:
        """Apply the peers each time node records change."""
        feed = view.subscribe({K.NODE})
        try:
            while True:
                peers = peers_of(view.nodes(), self.node_id)
                if peers != self.peers:
                    try:
                        await asyncio.to_thread(sync, self.config_path, self.private_key, peers)
                        log.info("mesh: %d peer(s): %s", len(peers), ", ".join(p.mesh_ip for p in peers) or "-")
                        self.peers = peers
                    except MeshError as exc:
                        log.error("mesh: %s", exc)
                await feed.wait(timeout=30.0)
        finally:
            feed.close()
