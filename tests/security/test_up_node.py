"""``zattera up --secure`` runs its local agent and proxy with their own credentials, never the control one."""

from __future__ import annotations

from pathlib import Path

from cli.up import LOCAL_NODE, Cluster
from shared.security.authority import RoleIssuer
from shared.security.creds import read_user_jwt, write_private
from shared.security.nkeyjwt import decode_claims
from shared.security.permissions import Role
from shared.security.setup import prepare


def test_the_local_node_gets_a_builder_and_a_proxy_credential(tmp_path: Path) -> None:
    setup = prepare(tmp_path / "security")
    cluster = Cluster(data_dir=tmp_path, creds=str(setup.control_creds), node_creds=setup.local_node_creds(LOCAL_NODE))
    services_env = {"ZATTERA_NATS_CREDS": str(setup.control_creds), "ZATTERA_NATS_URL": "nats://x"}

    for process, role in (("agent", Role.BUILDER), ("proxy", Role.PROXY)):
        env = cluster._node_env(services_env, process)
        assert env["ZATTERA_NATS_URL"] == "nats://x"
        claims = decode_claims(read_user_jwt(env["ZATTERA_NATS_CREDS"]))
        assert claims["name"] == LOCAL_NODE
        assert claims["iss"] == RoleIssuer.load(setup.directory, role).signing_key.public_key
    # A restart keeps the identities; an unsecured cluster changes nothing.
    assert setup.local_node_creds(LOCAL_NODE) == cluster.node_creds
    assert Cluster(data_dir=tmp_path)._node_env(services_env, "agent") == services_env


def test_a_credential_of_the_old_single_account_layout_is_issued_again(tmp_path: Path) -> None:
    """Before the role accounts every role was a user of ZATTERA: such a credential names the wrong account."""
    setup = prepare(tmp_path / "security")
    stale = setup.directory / "creds" / "proxy-p1.creds"
    write_private(stale, RoleIssuer.load(setup.directory, Role.CONTROL).creds("p1"))  # an account-ZATTERA user
    issued = setup.creds(Role.PROXY, "p1")
    claims = decode_claims(read_user_jwt(issued))
    assert claims["nats"]["issuer_account"] == RoleIssuer.load(setup.directory, Role.PROXY).account_public_key
    assert claims["iss"] == RoleIssuer.load(setup.directory, Role.PROXY).signing_key.public_key
