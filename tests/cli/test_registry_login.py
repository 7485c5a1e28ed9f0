"""``zattera registry login|logout`` against a real NATS server: the credentials are the environment's sealed
secret ``ZATTERA_REGISTRY_AUTH`` (opening to the JSON the agent hands the Docker daemon), and the password is
in no output. The pull with them: tests/agent/test_registry_auth.py."""

from __future__ import annotations

import json
from typing import Any

from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.registryauth import REGISTRY_AUTH_SECRET
from shared.secrets import unseal
from shared.state.feed import StateView
from shared.txn import Writer
from tests.cli.rig import Invoke, state
from tests.cli.test_config_secrets import ENV, applied, cluster_key, the_env

__all__ = ["applied", "cluster_key"]  # the fixtures this module uses

PASSWORD = "pw-7c1e-registry"


def test_registry_login_seals_the_credentials_and_logout_removes_them(
    cli: Invoke, nats_url: str, cluster_key: PrivateKey
) -> None:
    outputs = [
        cli("registry", "login", "ghcr.io", "--env", ENV, "--username", "bot", input=PASSWORD + "\n"),
        cli("secrets", "list", "--env", ENV, "--json"),
    ]
    assert all(o.exit_code == 0 for o in outputs), [o.output for o in outputs]
    assert not any(PASSWORD in o.output for o in outputs)
    assert [s["name"] for s in json.loads(outputs[-1].stdout)["secrets"]] == [REGISTRY_AUTH_SECRET]

    async def check(conn: Any, view: StateView, writer: Writer) -> None:
        ref = the_env(view).service.secrets[REGISTRY_AUTH_SECRET]
        record = view.get(K.SECRET, ref.secret_id)
        assert isinstance(record, pb.SealedSecret) and PASSWORD.encode() not in record.ciphertext
        opened = json.loads(unseal(cluster_key, record.ciphertext))
        assert opened == {"serveraddress": "ghcr.io", "username": "bot", "password": PASSWORD}

    state(nats_url, check)
    refused = cli("registry", "login", "https://ghcr.io", "--env", ENV, "-u", "bot", input=PASSWORD)
    assert refused.exit_code == 1 and "server:" in refused.output and PASSWORD not in refused.output
    assert cli("registry", "logout", "--env", ENV).exit_code == 0
    assert json.loads(cli("secrets", "list", "--env", ENV, "--json").stdout)["secrets"] == []
