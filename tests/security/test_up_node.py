"""``zattera up --secure`` runs its local agent and proxy with their own credentials, never the control one,
kept in their own directories: nothing in their environment points into the control plane's."""

from __future__ import annotations

from pathlib import Path

from cli.layout import NODE_CREDS, PROXY_CREDS, DataLayout
from cli.up_cluster import LOCAL_NODE, Cluster
from cli.up_node import node_env
from shared.security.authority import RoleIssuer
from shared.security.creds import read_user_jwt, write_private
from shared.security.nkeyjwt import decode_claims
from shared.security.permissions import Role
from shared.security.setup import prepare


def test_the_local_node_gets_a_builder_and_a_proxy_credential(tmp_path: Path) -> None:
    layout = DataLayout(tmp_path)
    setup = prepare(layout.security, tls=True)
    node_creds = {
        "agent": str(setup.issue(Role.BUILDER, LOCAL_NODE, layout.agent / NODE_CREDS)),
        "proxy": str(setup.issue(Role.PROXY, LOCAL_NODE, layout.proxy / PROXY_CREDS)),
    }
    ca = str(setup.tls_ca)
    cluster = Cluster(data_dir=tmp_path, creds=str(setup.control_creds), tls_ca=ca, node_creds=node_creds)
    services_env = {
        "ZATTERA_NATS_CREDS": str(setup.control_creds),
        "ZATTERA_NATS_TLS_CA": ca,
        "ZATTERA_DATA_DIR": str(layout.control),
        "ZATTERA_NATS_URL": "nats://x",
        "ZATTERA_SECRETS_KEY": "00" * 32,  # the cluster key, should an operator seed it from the environment
    }

    for process, role, directory in (("agent", Role.BUILDER, layout.agent), ("proxy", Role.PROXY, layout.proxy)):
        env = node_env(cluster, services_env, process, directory)
        assert env["ZATTERA_NATS_URL"] == "nats://x"
        assert env["ZATTERA_DATA_DIR"] == str(directory)
        for value in env.values():  # nothing names the control plane's directory
            assert str(layout.control) not in value, value
        assert "ZATTERA_SECRETS_KEY" not in env
        assert Path(env["ZATTERA_NATS_CREDS"]).parent == directory
        assert Path(env["ZATTERA_NATS_TLS_CA"]).read_bytes() == Path(ca).read_bytes()
        claims = decode_claims(read_user_jwt(env["ZATTERA_NATS_CREDS"]))
        assert claims["name"] == LOCAL_NODE
        assert claims["iss"] == RoleIssuer.load(setup.directory, role).signing_key.public_key
    assert not list((layout.security / "creds").glob("*-local.creds"))  # not among the control plane's
    # A restart keeps the identities; an unsecured cluster gives the node no credential.
    before = Path(node_creds["agent"]).read_text()
    assert str(setup.issue(Role.BUILDER, LOCAL_NODE, layout.agent / NODE_CREDS)) == node_creds["agent"]
    assert Path(node_creds["agent"]).read_text() == before
    open_env = node_env(Cluster(data_dir=tmp_path), {"ZATTERA_NATS_URL": "nats://x"}, "agent", layout.agent)
    assert open_env == {"ZATTERA_NATS_URL": "nats://x", "ZATTERA_DATA_DIR": str(layout.agent)}


def test_a_credential_of_the_old_single_account_layout_is_issued_again(tmp_path: Path) -> None:
    """Before the role accounts every role was a user of ZATTERA: such a credential names the wrong account."""
    setup = prepare(tmp_path / "security")
    stale = setup.directory / "creds" / "proxy-p1.creds"
    write_private(stale, RoleIssuer.load(setup.directory, Role.CONTROL).creds("p1"))  # an account-ZATTERA user
    issued = setup.creds(Role.PROXY, "p1")
    claims = decode_claims(read_user_jwt(issued))
    assert claims["nats"]["issuer_account"] == RoleIssuer.load(setup.directory, Role.PROXY).account_public_key
    assert claims["iss"] == RoleIssuer.load(setup.directory, Role.PROXY).signing_key.public_key
