"""Config and secrets, end to end: real NATS, every service (the secrets service too), two agents, the proxy
and the real CLI.

The app is examples/hello with one more route, ``/env/<NAME>``, answering the SHA-256 of that variable, so a
test checks what the process sees without the value ever crossing a wire or a log. The tests share one
cluster and run in order; the last one greps every file the cluster wrote for the secret values.
"""

from __future__ import annotations

import hashlib
import json
import secrets as pysecrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from nacl.exceptions import CryptoError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.secrets import load_keyring, open_subject, unseal
from tests.e2e.cluster import E2ECluster, Load, app_source, env_by_name, healthy
from tests.e2e.conftest import running
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ENV = "vault/web/production"
HOST = "vault.localhost"
PLAIN = "plain-greeting-" + pysecrets.token_hex(8)
FIRST = "first-secret-" + pysecrets.token_hex(16)
SECOND = "second-secret-" + pysecrets.token_hex(16)

ENV_ROUTE = """        if self.path.startswith("/env/"):
            value = os.environ.get(self.path.removeprefix("/env/"))
            digest = hashlib.sha256(value.encode()).hexdigest() if value is not None else None
            body = json.dumps({"sha256": digest}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
"""

SPEC = f"""
project = "vault"
app = "web"

[run]
command = "python3 app.py"

[env.production]
replicas = {{ min = 2, max = 2 }}
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }}
domains = ["{HOST}"]

[env.production.vars]
GREETING = "{PLAIN}"
"""


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    """The shared harness with a node deadline that an agent's restart never reaches: a restart keeps the
    node's replicas there (the point of the re-registration test), while the harness's 4 s deadline is
    shorter than an agent's start on a loaded machine (about 2 s of CPU for its imports), and a node that
    misses it is rightly declared lost and its replicas placed elsewhere."""
    yield from running(E2ECluster(tmp_path_factory.mktemp("e2e"), timers={"ZATTERA_NODE_HEARTBEAT_DEADLINE": "60"}))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = app_source(tmp_path_factory.mktemp("vault-src") / "app", "v1")
    app = (src / "app.py").read_text()
    app = app.replace("import json\n", "import hashlib\nimport json\n", 1)
    app = app.replace(
        "    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name\n",
        "    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name\n" + ENV_ROUTE,
        1,
    )
    (src / "app.py").write_text(app)
    (src / "zattera.toml").write_text(SPEC)
    return src


@pytest.fixture(scope="module")
def value_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Values reach the CLI through files outside the cluster's directory (the grep covers all of it)."""
    root = tmp_path_factory.mktemp("values")
    out = {}
    for value in (FIRST, SECOND):
        path = root / value[:6]
        path.write_text(value)
        out[value] = path
    return out


async def seen(cluster: E2ECluster, name: str, samples: int = 8) -> set[str | None]:
    """The digests of ``name`` that the replicas answer (several requests: both replicas get asked)."""
    digests: set[str | None] = set()
    for _ in range(samples):
        status, body = await cluster.get(HOST, f"/env/{name}")
        assert status == 200, body
        digests.add(json.loads(body)["sha256"])
    return digests


async def only(cluster: E2ECluster, name: str, value: str | None, what: str) -> None:
    expected = {sha(value) if value is not None else None}
    await eventually(lambda: _equals(cluster, name, expected), 60, what)


async def _equals(cluster: E2ECluster, name: str, expected: set[str | None]) -> bool:
    try:
        return await seen(cluster, name) == expected
    except AssertionError:  # a replica going away mid-check; the Load of each test counts real failures
        return False


def deployment_id_of(stderr: str) -> str:
    for word in stderr.replace("(", " ").replace(")", " ").split():
        if len(word) == 26 and word.isalnum() and word.isupper():
            return word
    raise AssertionError(f"no deployment id in:\n{stderr}")


async def test_the_app_sees_its_variables_and_secrets(
    cluster: E2ECluster, source: Path, value_files: dict[str, Path]
) -> None:
    await cluster.acli("apps", "apply", str(source / "zattera.toml"))
    staged = await cluster.acli("secrets", "set", "--env", ENV, "API_TOKEN", "--from-file", str(value_files[FIRST]))
    assert "used by the first deploy" in staged.stderr, staged.stderr
    deployed = await cluster.acli("deploy", str(source), "--env", ENV)
    assert "live: release" in deployed.stderr, deployed.stderr
    await only(cluster, "GREETING", PLAIN, "the replicas see the plain variable")
    await only(cluster, "API_TOKEN", FIRST, "the replicas see the secret")
    await only(cluster, "NOT_SET", None, "an unknown name is absent")


async def test_a_secret_change_rolls_out_red_green_without_a_failed_request(
    cluster: E2ECluster, value_files: dict[str, Path]
) -> None:
    load = Load(cluster.proxy_port, HOST, rate=40).start()
    changed = await cluster.acli("secrets", "set", "--env", ENV, "API_TOKEN", "--from-file", str(value_files[SECOND]))
    await only(cluster, "API_TOKEN", SECOND, "the new value is served")
    await load.stop()
    assert "rolling out" in changed.stderr and "live: release" in changed.stderr, changed.stderr
    assert not load.failures, load.summary()
    assert load.ok > 20, load.summary()
    listed = json.loads((await cluster.acli("secrets", "list", "--env", ENV, "--json")).stdout)
    assert [(s["name"], s["version"], s["running_version"]) for s in listed["secrets"]] == [("API_TOKEN", 2, 2)]
    releases = (await cluster.acli("releases", "--env", ENV)).stdout
    assert "config" in releases


async def test_rollback_restores_the_previous_values(cluster: E2ECluster) -> None:
    await cluster.acli("rollback", "--env", ENV)
    await only(cluster, "API_TOKEN", FIRST, "the rollback serves the previous secret")
    await only(cluster, "GREETING", PLAIN, "and the same variable")


async def test_a_node_cannot_open_secrets_of_an_assignment_it_does_not_run(cluster: E2ECluster) -> None:
    async with cluster.state() as (conn, view):
        env = env_by_name(view, "production")
        assert env is not None
        live = [a for a in healthy(view, env.meta.id) if view.release(a.release_id).service.secrets]  # type: ignore[union-attr]
        assert live
        victim = live[0]
        other = next(n for n in cluster.nodes if n != victim.node_id)
        for node_id, key in ((other, b""), (victim.node_id, b"\x01" * 32)):
            request = cpb.OpenSecretsRequest(node_id=node_id, assignment_id=victim.meta.id, node_public_key=key)
            reply = await conn.nc.request(open_subject(node_id), request.SerializeToString(), timeout=10)
            answer = cpb.OpenSecretsResponse.FromString(reply.data)
            assert answer.error and not answer.sealed, answer


async def test_key_rotation_keeps_apps_running_and_old_ciphertexts_need_the_old_key(cluster: E2ECluster) -> None:
    async with cluster.state() as (_, view):
        env = env_by_name(view, "production")
        assert env is not None
        before = {s.meta.id: s.ciphertext for s in view.secrets(env.meta.id)}
        # The rotation re-seals every sealed record: secrets, and the certificate manager's keys (docs/certificates.md).
        sealed_elsewhere = view.count(K.CERT) + view.count(K.ACME_ACCOUNT)
        pids = {n: sorted(cluster.instance_pids(n)) for n in cluster.nodes}
    load = Load(cluster.proxy_port, HOST, rate=40).start()
    rotated = json.loads((await cluster.acli("secrets", "rotate-key", "--json")).stdout)
    await only(cluster, "API_TOKEN", FIRST, "still served after the rotation")
    await load.stop()
    assert not load.failures, load.summary()
    assert rotated["resealed"] == len(before) + sealed_elsewhere and len(before) >= 2, rotated
    assert {n: sorted(cluster.instance_pids(n)) for n in cluster.nodes} == pids  # nothing restarted

    keyring = load_keyring(cluster.root / "control" / "secrets" / "cluster.key")  # the control plane's data dir
    assert keyring is not None and len(keyring.keys) == 1
    for ciphertext in before.values():
        with pytest.raises(CryptoError):
            unseal(keyring.current, ciphertext)
    # New instances open the re-sealed secrets: a config change rolls out a release that needs them.
    await cluster.acli("config", "set", "--env", ENV, "EXTRA=1")
    await only(cluster, "EXTRA", "1", "the new release runs")
    await only(cluster, "API_TOKEN", SECOND, "the env's staged secret, opened with the rotated key")
    async with cluster.state() as (_, view):
        assert all(s.key_id == rotated["key_id"] for s in view.all(K.SECRET))
        assert view.get(K.SECRETS_KEY, "cluster").key_id == rotated["key_id"]  # type: ignore[union-attr]
        assert isinstance(view.get(K.SECRETS_KEY, "cluster"), pb.SecretsKey)


async def test_a_restarted_agent_registers_a_new_node_key_and_its_instances_get_their_secrets(
    cluster: E2ECluster,
) -> None:
    node_id = cluster.nodes[-1]
    async with cluster.state() as (_, view):
        old_key = view.node(node_id).secrets_public_key  # type: ignore[union-attr]
        env = env_by_name(view, "production")
        assert env is not None and old_key
        old_pids = set(cluster.instance_pids(node_id))
        assert old_pids
        cluster.child(f"agent-{node_id}").terminate()  # the harness restarts it: a re-registration
        await eventually(
            lambda: view.node(node_id).secrets_public_key not in (b"", old_key),  # type: ignore[union-attr]
            60,
            "the node re-registered with a new key",
        )
        await eventually(
            lambda: (
                bool(set(cluster.instance_pids(node_id)) - old_pids)
                and len(healthy(view, env.meta.id, env.active_release_id)) == 2
            ),
            60,
            "its instances started again, with their secrets",
        )
    await only(cluster, "API_TOKEN", SECOND, "the restarted instances see the secret")


def test_no_plaintext_secret_anywhere_the_cluster_wrote(cluster: E2ECluster) -> None:
    """Every file under the cluster's root: the NATS store, every agent's data dir, every log, the traces."""
    found_plain = []
    leaks = []
    for path in cluster.root.rglob("*"):
        if not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if PLAIN.encode() in data:
            found_plain.append(path)
        leaks.extend(f"{path}: {v[:6]}…" for v in (FIRST, SECOND) if v.encode() in data)
    # The grep does read the store: the plain (not secret) variable is in it, in the clear.
    assert any("nats" in str(p.relative_to(cluster.root)) for p in found_plain), found_plain
    assert not leaks, leaks
