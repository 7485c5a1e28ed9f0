"""Backup and disaster recovery through ``zattera up`` (issue 35): what a backup of N envs and M bytes of
volume data costs, and how long a fresh machine takes to serve every env again from it (the RTO).

Run: ``python -m benchmarks.backup_bench [--full] [--json]`` (also part of ``make bench``).

The scenario, as an operator runs it, every step a real process: ``zattera up`` on a data directory
(embedded NATS, every service, an agent, the proxy); N envs of the example app (one replica each, a
hostname each) and one stateful env whose volume holds M bytes; ``zattera volumes snapshot``; ``zattera
backup create --to s3://…`` twice (the second of the unchanged cluster); Ctrl-C, the data directory
deleted; ``zattera up`` on a new data directory, ``zattera restore``, then requests through the new proxy
until every env answers 200 (the stateful one with the note it wrote on the old machine).

1. **Backup**: duration and bytes sent of the first backup, and the second's bytes. Target: the second
   sends < 1 % of the first.
2. **RTO**: from starting ``zattera up`` on the empty data directory to every env serving through the
   proxy (and its parts: ``up`` ready, ``restore`` command, restore → serving). Target ≤ 60 s for 10 envs.

Quick: 2 envs, 8 MiB of volume data. Full: 10 envs with 8 MiB (the envs' own RTO), then 10 envs and 100
envs with 1 GiB of volume data.

What it bypasses: the S3 target is moto's server in this process on loopback (no network between the
machine and the store, no bandwidth limit: real object stores add their latency per object and their
throughput); the volume data is written straight into the volume's directory on the node (random bytes,
incompressible; the app only mounts it); "a new machine" is a new data directory on this machine (same
NATS and proxy ports, same CPU), so the restore does not download any image or source over a network;
apps run on the process runtime (no container image pulls); the envs are deployed and the cluster is idle
before the backup. The passphrase KDF runs at its production limits (Argon2id 256 MiB, 3 passes) once per
backup and once per restore: its cost is inside both figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import boto3
from moto.server import ThreadedMotoServer

from benchmarks.common import Row, bench_main, row
from shared.embedded import free_port
from tests.e2e.cluster import EXAMPLE, kill_tree_under
from tests.e2e.test_backup_drill import NOTES_APP, NOTES_ENV, NOTES_HOST, NOTES_TOML
from tests.e2e.upcmd import Up
from tests.waiting import eventually

MIB = 1 << 20
BUCKET = "zattera-bench"
PASSPHRASE = "bench recovery passphrase, long enough"
ENV_TEMPLATE = """
[env.e{i}]
replicas = {{ min = 1, max = 1 }}
resources = {{ cpu_millis = 10, memory_mb = 32 }}
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "20s" }}
domains = ["e{i}.bench.localhost"]
"""


def _web_app(root: Path, envs: int) -> Path:
    app = root / "web"
    app.mkdir()
    shutil.copy(EXAMPLE / "app.py", app / "app.py")
    body = 'project = "bench"\napp = "web"\n\n[run]\ncommand = "python3 app.py"\n'
    body += "".join(ENV_TEMPLATE.format(i=i) for i in range(envs))
    (app / "zattera.toml").write_text(body)
    return app


def _notes_app(root: Path) -> Path:
    notes = root / "notes"
    notes.mkdir()
    (notes / "zattera.toml").write_text(NOTES_TOML)
    (notes / "app.py").write_text(NOTES_APP)
    return notes


async def _get(session: aiohttp.ClientSession, port: int, host: str) -> str | None:
    """The body when ``host`` answers 200 through the proxy, else None."""
    try:
        async with session.get(f"http://127.0.0.1:{port}/", headers={"Host": host}) as response:
            return (await response.text()) if response.status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


async def _all_serving(port: int, hosts: list[str], note: str, timeout: float) -> None:
    """Until every host answers 200 (and the notes host answers ``note`` when given)."""
    waiting = set(hosts)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:

        async def check() -> bool:
            bodies = await asyncio.gather(*(_get(session, port, h) for h in sorted(waiting)))
            for host, body in zip(sorted(waiting), bodies, strict=True):
                if body is not None and (host != NOTES_HOST or not note or body == note):
                    waiting.discard(host)
            return not waiting

        await eventually(check, timeout, f"every env serving ({len(hosts)} envs)")


def _write_volume(data_dir: Path, volume_id: str, size: int) -> None:
    """``size`` random bytes into the volume's directory on the node (64 MiB files)."""
    home = next(p for p in data_dir.rglob(volume_id) if p.is_dir())
    written = 0
    while written < size:
        piece = min(64 * MIB, size - written)
        (home / f"blob-{written // (64 * MIB):04d}.bin").write_bytes(os.urandom(piece))
        written += piece


def _created(up: Up, target: str, data_dir: Path) -> tuple[float, dict[str, int]]:
    started = time.perf_counter()
    done = up.cli("backup", "create", "--to", target, "--data-dir", str(data_dir), "--json", timeout=1800)
    return time.perf_counter() - started, json.loads(done.stdout)


async def _scenario(envs: int, volume_bytes: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="zattera-backup-bench-"))
    s3_port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    server.start()
    aws = {
        "AWS_ACCESS_KEY_ID": "AKIABENCH0000000001",
        "AWS_SECRET_ACCESS_KEY": "bench-secret",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    boto3.client(
        "s3",
        aws_access_key_id=aws["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=aws["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)
    env = {**aws, "ZATTERA_RECOVERY_PASSPHRASE": PASSPHRASE}
    target = f"s3://{BUCKET}/bench"
    old, new = root / "old-machine", root / "new-machine"
    nats_port, proxy_port = free_port(), free_port()
    web, notes = _web_app(root, envs), _notes_app(root)
    hosts = [f"e{i}.bench.localhost" for i in range(envs)] + [NOTES_HOST]
    out: dict[str, float] = {}
    up = Up(old, nats_port, proxy_port, env=env)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 120, "zattera up is up")
        up.cli("apps", "apply", str(web / "zattera.toml"))
        up.cli("apps", "apply", str(notes / "zattera.toml"))
        with ThreadPoolExecutor(4) as pool:
            deploys = [pool.submit(up.cli, "deploy", str(web), "--env", f"bench/web/e{i}") for i in range(envs)]
            deploys.append(pool.submit(up.cli, "deploy", str(notes), "--env", NOTES_ENV))
            for deploy in deploys:
                deploy.result()
        await _all_serving(proxy_port, hosts, "", 120 + 3 * envs)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            note = await _get(session, proxy_port, NOTES_HOST) or ""
        (volume,) = json.loads(up.cli("volumes", "list", "--json").stdout)
        _write_volume(old, volume["meta"]["id"], volume_bytes)
        started = time.perf_counter()
        up.cli("volumes", "snapshot", volume["meta"]["id"], timeout=1800)
        out["snapshot_s"] = time.perf_counter() - started
        out["first_s"], first = _created(up, target, old)
        out["second_s"], second = _created(up, target, old)
        out["first_bytes"], out["second_bytes"] = first["sent_bytes"], second["sent_bytes"]
        assert up.ctrl_c(120) == 0, up.text()[-3000:]
    finally:
        up.kill()
        kill_tree_under(old, also_matching=str(old))
    shutil.rmtree(old)

    started = time.perf_counter()
    up = Up(new, nats_port, proxy_port, env=env)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 120, "zattera up is up on the new machine")
        out["up_s"] = time.perf_counter() - started
        restoring = time.perf_counter()
        up.cli("restore", "--from", target, "--data-dir", str(new), timeout=1800)
        out["restore_cmd_s"] = time.perf_counter() - restoring
        await _all_serving(proxy_port, hosts, note, 600)
        out["rto_s"] = time.perf_counter() - started
        out["serving_after_restore_s"] = time.perf_counter() - restoring
        assert up.ctrl_c(120) == 0, up.text()[-3000:]
    finally:
        up.kill()
        kill_tree_under(new, also_matching=str(new))
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def _rows(envs: int, volume_bytes: int, m: dict[str, float]) -> list[Row]:
    size = f"{envs} envs + {volume_bytes / MIB:,.0f} MiB of volume"
    share = 100.0 * m["second_bytes"] / m["first_bytes"]
    return [
        row(f"backup ({size}): first backup duration", m["first_s"], "s"),
        row(f"backup ({size}): first backup bytes sent", m["first_bytes"] / MIB, "MiB"),
        row(f"backup ({size}): second backup (unchanged) duration", m["second_s"], "s"),
        row(
            f"backup ({size}): second backup bytes sent",
            m["second_bytes"] / 1024,
            "KiB",
            "< 1 % of the first",
            f"{share:.3f} % of the first",
        ),
        row(f"backup ({size}): volume snapshot before it", m["snapshot_s"], "s"),
        row(
            f"restore ({size}): RTO, zattera up on an empty data dir → every env serving",
            m["rto_s"],
            "s",
            "≤ 60 s for 10 envs",
            f"up ready {m['up_s']:.1f} s, restore command {m['restore_cmd_s']:.1f} s, "
            f"restore start → all serving {m['serving_after_restore_s']:.1f} s",
        ),
    ]


def run(quick: bool = True) -> list[Row]:
    cases = [(2, 8 * MIB)] if quick else [(10, 8 * MIB), (10, 1024 * MIB), (100, 1024 * MIB)]
    rows: list[Row] = []
    for envs, volume_bytes in cases:
        measured = asyncio.run(_scenario(envs, volume_bytes))
        print(f"backup_bench {envs} envs, {volume_bytes} volume bytes: {json.dumps(measured)}", flush=True)
        rows += _rows(envs, volume_bytes, measured)
    return rows


def main() -> None:
    bench_main("Backup and restore", run, __doc__, "10 envs + 8 MiB, 10 and 100 envs + 1 GiB of volume data")


if __name__ == "__main__":
    main()
