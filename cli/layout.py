"""Where ``zattera up`` keeps each process's files under its data directory, apart from each other.

```
<data>/            0700
  control/         the control plane: nats/ (the embedded server's store and configuration), security/
                   (operator, account and role keys, the services' and operators' credentials, TLS),
                   secrets/cluster.key, certs/ (the local CA), console/ …  Its services run with
                   ZATTERA_DATA_DIR=<data>/control.
  agent/           the local node's agent: node.creds (its own credential, --secure), instances/, volumes/,
                   builds/, sandbox/ (its environments' uids) — and nothing of the control plane's
  proxy/           the local proxy: proxy.creds (--secure), its route and certificate caches
  logs/            every process's log
```

Each directory is 0700 and root's (or the user's who runs ``zattera up``); an app's sandbox shows it none of
them (services/agent/sandbox.py). A data directory laid out as before (``nats``, ``security``, ``secrets``,
``certs``, ``console`` and ``nats-cluster`` at its top, the node's own credentials among the control
plane's) is moved into this layout in place by :meth:`DataLayout.migrate`, idempotently: each entry is one
rename, a second run finds nothing left to move. A machine of a cluster of machines (``cli/machine.py``)
uses the same layout (a worker's ``control/`` holds only the cluster's CA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CONTROL_ENTRIES = ("nats", "nats-cluster", "security", "secrets", "certs", "console")
"""What belonged to the control plane at the top of a data directory laid out as before."""
OLD_NODE_CREDS = {
    "creds/builder-local.creds": ("agent", "node.creds"),
    "creds/proxy-local.creds": ("proxy", "proxy.creds"),
    "creds/agent.creds": ("agent", "node.creds"),
    "creds/proxy.creds": ("proxy", "proxy.creds"),
}
"""The node's own credentials, once kept among the control plane's (``zattera up --secure``; a machine of a
cluster of machines), and where they go now."""
NODE_CREDS = "node.creds"
PROXY_CREDS = "proxy.creds"
NATS_CA = "nats-ca.pem"


@dataclass(frozen=True)
class DataLayout:
    root: Path

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def security(self) -> Path:
        return self.control / "security"

    @property
    def agent(self) -> Path:
        return self.root / "agent"

    @property
    def proxy(self) -> Path:
        return self.root / "proxy"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def local_ca(self) -> Path:
        return self.control / "certs" / "local-ca.pem"

    def make(self) -> None:
        """Create the directories (0700; existing ones are made 0700 too)."""
        for directory in (self.root, self.control, self.agent, self.proxy, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, 0o700)

    def migrate(self) -> list[str]:
        """Move a previous layout's control-plane entries under ``control/`` and drop the local node's
        credentials from among the control plane's (re-issued into ``agent/`` and ``proxy/``); returns what
        was done, one line each. An entry present at both places is left where it is (said so)."""
        done: list[str] = []
        for name in CONTROL_ENTRIES:
            old = self.root / name
            if old.exists() or old.is_symlink():
                done.append(_move(old, self.control / name))
        for name, (owner, file) in OLD_NODE_CREDS.items():
            old = self.security / name
            if old.exists():
                done.append(
                    _move(old, self.root / owner / file, " (the node's own credential, apart from the control plane's)")
                )
        return done


def _move(old: Path, new: Path, why: str = "") -> str:
    """Rename ``old`` to ``new`` (its directory made, 0700), unless ``new`` exists; says which was done."""
    if new.exists():
        return f"{old} left in place: {new} exists already (remove the one you do not use)"
    new.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(new.parent, 0o700)
    old.rename(new)
    return f"moved {old} to {new}{why}"
