"""``zattera apps|envs|projects delete``, ``zattera scale`` and ``zattera status`` against a real NATS server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.clock import to_timestamp
from shared.live import publish_proxy_heartbeat
from shared.state.feed import StateView
from tests.cli.rig import state
from tests.cli.test_cli import VALID
from tests.factories import assignment, node

PROD = "demo/hello/production"


@pytest.fixture
def applied(cli, tmp_path: Path) -> dict[str, str]:
    """The VALID spec applied: env name -> id."""
    spec = tmp_path / "zattera.toml"
    spec.write_text(VALID)
    assert cli("apps", "apply", str(spec)).exit_code == 0
    return {e["name"]: e["meta"]["id"] for e in json.loads(cli("apps", "list", "--json").stdout)}


def _seed_replicas_and_volume(nats_url: str, env_id: str) -> None:
    async def seed(conn, view, writer):
        txn = writer.txn()
        for i in range(2):
            txn.create(assignment(f"n{i}", env_id, "rel1", assignment_id=f"run-{i}"))
        volume = pb.Volume(project_id=view.env(env_id).project_id, environment_id=env_id, name="data", node_id="n0")
        volume.meta.id = "vol1"
        snapshot = pb.VolumeSnapshot(volume_id="vol1", status=pb.SNAPSHOT_STATUS_COMPLETE)
        snapshot.meta.id = "snap1"
        txn.create(volume).create(snapshot)
        placing = pb.Deployment(environment_id=env_id, release_id="rel2", phase=pb.DEPLOYMENT_PHASE_PLACING)
        placing.meta.id = "dep-placing"
        txn.create(placing)
        await writer.commit(txn)

    state(nats_url, seed)


def _read(nats_url: str, fn):
    async def go(conn, view: StateView, writer):
        return fn(view)

    return state(nats_url, go)


def test_delete_refuses_without_yes_when_there_is_no_terminal(cli, nats_url, applied):
    _seed_replicas_and_volume(nats_url, applied["production"])
    for args in (("envs", "delete", PROD), ("apps", "delete", "demo/hello"), ("projects", "delete", "demo")):
        refused = cli(*args)
        assert refused.exit_code == 2, refused.stderr
        assert "needs confirmation: pass --yes" in refused.stderr
    still = _read(nats_url, lambda v: (v.env(applied["production"]), [a.desired for a in v.assignments()]))
    assert still[0] is not None and still[1] == [pb.ASSIGNMENT_DESIRED_RUN] * 2


def test_env_delete_stops_replicas_removes_domains_keeps_volumes_and_records_an_event(
    cli,
    nats_url,
    applied,
):
    prod = applied["production"]
    _seed_replicas_and_volume(nats_url, prod)
    assert _read(nats_url, lambda v: len(v.domains(prod))) == 1
    done = cli("envs", "delete", PROD, "--yes", "--json")
    assert done.exit_code == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["environments"] == 1 and summary["replicas_stopped"] == 2 and summary["volumes_kept"] == 1
    assert summary["deployments_ended"] == 1

    def after(view: StateView):
        return (
            view.env(prod),
            view.domains(),
            [a.desired for a in view.assignments(prod)],
            [v.meta.id for v in view.volumes()],
            [s.meta.id for s in view.snapshots()],
            view.env(applied["staging"]) is not None,
            view.deployment("dep-placing"),
        )

    env, domains, desired, volumes, snapshots, staging_kept, ended = _read(nats_url, after)
    assert (ended.phase, ended.error) == (pb.DEPLOYMENT_PHASE_FAILED, "environment deleted")
    assert env is None and domains == []
    assert desired == [pb.ASSIGNMENT_DESIRED_STOP] * 2  # the scheduler reaps them once stopped
    assert volumes == ["vol1"] and snapshots == ["snap1"]
    assert staging_kept
    events = cli("events", "--json", "--kind", "env.deleted")
    assert "environment production deleted: 2 replica(s) stopped, 1 volume(s) kept" in events.stdout
    missing = cli("envs", "delete", PROD, "--yes")
    assert missing.exit_code == 1 and "not found" in missing.stderr


def test_project_delete_with_volumes_removes_everything_under_it(cli, nats_url, applied):
    _seed_replicas_and_volume(nats_url, applied["production"])
    assert cli("projects", "delete", "demo", "--yes", "--volumes").exit_code == 0

    def left(view: StateView):
        kinds = (K.PROJECT, K.APP, K.ENV, K.DOMAIN, K.VOLUME, K.SNAPSHOT)
        return {kind: len(view.all(kind)) for kind in kinds}, [a.desired for a in view.assignments()]

    counts, desired = _read(nats_url, left)
    assert counts == dict.fromkeys(counts, 0)
    assert desired == [pb.ASSIGNMENT_DESIRED_STOP] * 2


# ---------------------------------------------------------------------------------------------- scale


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--min", "3", "--max", "2"), "--max: max 2 is below min 3"),
        (("5", "--max", "3"), "REPLICAS 5: outside --min 2 / --max 3"),
        (("--min", "-1"), "--min -1: must be 0 or more"),
        ((), "give REPLICAS"),
    ],
)
def test_scale_refuses_bad_requests_naming_the_option(cli, applied, args, message):
    refused = cli("scale", "--env", PROD, *args)
    assert refused.exit_code != 0 and message in refused.stderr, refused.stderr


def test_scale_then_status_and_apps_list_show_the_effective_count(cli, nats_url, applied):
    done = cli("scale", "--env", PROD, "3", "--json")
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout) == {"env": PROD, "replicas": 3, "min": 3, "max": 3}
    prod = _read(nats_url, lambda v: v.env(applied["production"]))
    assert (prod.service.replicas.min, prod.service.replicas.max, prod.effective_replicas) == (3, 3, 3)
    assert "scaled demo/hello/production to 3 replica(s)" in cli("events", "--json", "--kind", "env.scaled").stdout

    async def deploy_and_cool_staging(conn, view: StateView, writer):
        staging = pb.Environment()
        staging.CopyFrom(view.env(applied["staging"]))
        staging.active_release_id, staging.effective_replicas = "rel-s", 0  # deployed, then cooled to zero
        await writer.commit(writer.txn().put(staging))

    state(nats_url, deploy_and_cool_staging)
    listed = cli("apps", "list")
    staging_row = next(line for line in listed.stdout.splitlines() if "staging" in line)
    assert staging_row.split("│")[-2].strip() == "0", listed.stdout  # desired 0, not replicas.min 1

    rows = {r["env"]: r for r in json.loads(cli("status", "--json").stdout)}
    assert rows[PROD]["desired"] == 0 and rows[PROD]["state"] == "not deployed"
    staging = rows["demo/hello/staging"]
    assert (staging["desired"], staging["running"], staging["state"]) == (0, 0, "cold")
    table = cli("status")
    assert table.exit_code == 0 and "cold" in table.stdout


def test_status_and_ps_say_why_replicas_have_no_node(cli, nats_url, applied):
    async def seed(conn, view: StateView, writer):
        env = pb.Environment()
        env.CopyFrom(view.env(applied["production"]))
        env.active_release_id, env.effective_replicas = "rel-arm", 2
        release = pb.Release(environment_id=env.meta.id, version=1, platforms=["linux/arm64"])
        release.meta.id = "rel-arm"
        release.service.resources.memory_mb = 512
        txn = writer.txn().put(env).create(release)
        txn.create(node("amd1", os_arch="linux/amd64")).create(node("amd2", os_arch="linux/amd64"))
        txn.create(node("arm-small", os_arch="linux/arm64", mem=256))
        await writer.commit(txn)

    state(nats_url, seed)
    rows = {r["env"]: r for r in json.loads(cli("status", "--json").stdout)}
    assert rows[PROD]["placement"] == {
        "unplaced": 2,
        "nodes": 3,
        "filtered": {"arch": 2, "memory": 1},
        "with_room": 0,
        "why": "3 nodes: 2 filtered by arch, 1 by memory",
    }
    assert rows["demo/hello/staging"]["placement"] is None  # not deployed: nothing to place
    why = "demo/hello/production: 2 replicas unplaced — 3 nodes: 2 filtered by arch, 1 by memory"
    assert why in cli("status").stdout
    assert why in cli("ps", "--env", PROD).stdout


def test_status_shows_the_urls_that_work_with_the_proxies_ports_and_https_once_certified(cli, nats_url, applied):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ZATTERA_DOMAIN": "localhost"}
    routes = subprocess.Popen(
        [sys.executable, "-m", "services.routes", "--nats", nats_url], cwd=root, env=env, stderr=subprocess.DEVNULL
    )
    try:

        async def proxy_and_certificate(conn, view, writer):
            beat = cpb.ProxyHeartbeat(proxy_id="edge", http_port=8080, https_port=8443, time=to_timestamp(time.time()))
            await publish_proxy_heartbeat(conn, beat)
            issued = pb.Certificate(hostname="hello.example.com", state=pb.CERTIFICATE_STATE_VALID, chain_pem="PEM")
            issued.not_after.CopyFrom(to_timestamp(time.time() + 86400))
            issued.meta.id = K.cert_id("hello.example.com")
            await writer.commit(writer.txn().put(issued))

        state(nats_url, proxy_and_certificate)
        want = ["http://hello-production.localhost:8080", "https://hello.example.com:8443"]
        deadline = time.monotonic() + 30
        while True:
            rows = {r["env"]: r for r in json.loads(cli("status", "--json").stdout)}
            if rows[PROD]["urls"] == want or time.monotonic() > deadline:
                break
        assert rows[PROD]["urls"] == want
        assert "https://hello.example.com:8443" in cli("status").stdout
    finally:
        routes.terminate()
        routes.wait(10)
