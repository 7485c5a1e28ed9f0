"""``zattera network``: envs' names, the address apps reach them at, VIPs, ports and allowlists from the
state, as a table and as JSON (the VIP, which nothing listens on, only with --wide); a bad --env is one line
naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.rig import Invoke, state
from tests.routes import state as S

SPEC = """
project = "shop"
app = "db"

[env.production]
ports = [{ name = "pg", container_port = 5432, protocol = "tcp" }, { name = "http" }]
scale_to_zero = true

[env.production.network]
allow = ["billing/api/production"]
"""


def test_network_lists_names_vips_ports_and_allowlists(cli: Invoke, nats_url: str, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    assert cli("apps", "apply", str(spec)).exit_code == 0

    async def allocate(conn, view, writer):  # what the routes service's VIP allocator does
        (env,) = view.envs()
        await S.commit(writer, S.vip(env.meta.id, "127.128.0.2"))
        return env.meta.id

    env_id = state(nats_url, allocate)
    result = cli("network", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [
        {
            "env": "shop/db/production",
            "env_id": env_id,
            "name": "db.production.shop.internal",
            "vip": "127.128.0.2",
            "app_address": "127.(128+c).0.2",
            "ports": [{"name": "pg", "port": 5432}, {"name": "http", "port": 80}],
            "scale_to_zero": True,
            "allow": ["billing/api/production"],
        }
    ]
    table = cli("network", "--env", "shop/db/production")
    assert table.exit_code == 0 and "db.production.shop.internal" in table.stdout and "pg:5432, http:80" in table.stdout
    assert "127.(128+c).0.2" in table.stdout and "ZATTERA_SERVICE_<APP>_<ENV>_HOST" in table.stdout
    assert "127.128.0.2" not in table.stdout  # not shown as an address: nothing listens on it
    wide = cli("network", "--wide")
    assert wide.exit_code == 0 and "127.128.0.2" in wide.stdout and env_id in wide.stdout

    bad = cli("network", "--env", "shop/nope/production")
    assert bad.exit_code == 1 and "--env: no environment 'shop/nope/production'" in bad.stderr
