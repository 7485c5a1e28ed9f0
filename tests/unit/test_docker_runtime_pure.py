"""Pure parts of the docker runtime and the image-archive reader: table tests, no daemon."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from services.agent.docker_containers import Resume, container_config, cpu_percent, exit_of, resident_bytes, since_param
from services.agent.docker_images import ContainerImage
from services.agent.docker_runtime import DockerLauncher
from services.agent.images import ImageError
from services.agent.launchers import LABEL_ASSIGNMENT, Launch, LaunchPlan
from shared.imagearchive import ImageArchiveError, read_image_archive


def _tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_container_config_carries_every_limit_and_hardening() -> None:
    image = ContainerImage("ref", Path("/app"), tag="zattera-local:abc")
    plan = LaunchPlan(memory_mb=64, cpu_millis=250, read_only_root=True, volumes={"data": (Path("/v/V1"), "/data")})
    config = container_config(["sh", "-c", "run"], image=image, env={"PORT": "1"}, plan=plan, labels={}, pids_limit=9)
    host = config["HostConfig"]
    assert (config["Entrypoint"], config["Cmd"], config["User"]) == (["sh"], ["-c", "run"], "65534:65534")
    assert host["Memory"] == host["MemorySwap"] == 64 * 1024 * 1024
    assert (host["NanoCpus"], host["PidsLimit"], host["NetworkMode"]) == (250_000_000, 9, "host")
    assert host["CapDrop"] == ["ALL"] and host["SecurityOpt"] == ["no-new-privileges"] and host["Init"]
    assert host["ReadonlyRootfs"] and "/tmp" in host["Tmpfs"]
    assert host["Binds"] == ["/v/V1:/data"]


def test_no_limit_asked_none_set_and_the_images_user_wins() -> None:
    image = ContainerImage("ref", Path("/"), tag="t", user="1000")
    config = container_config(["app"], image=image, env={}, plan=LaunchPlan(), labels={}, pids_limit=0)
    assert config["User"] == "1000"
    assert not {"Memory", "NanoCpus", "PidsLimit", "Tmpfs"} & set(config["HostConfig"])


def test_the_environments_user_wins_over_the_images() -> None:
    """A node's containers run as their environment's uid (the network fence's range), whatever the image says."""
    image = ContainerImage("ref", Path("/"), tag="t", user="root")
    config = container_config(["app"], image=image, env={}, plan=LaunchPlan(), labels={}, pids_limit=0, user="7:7")
    assert config["User"] == "7:7"


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"OOMKilled": True, "ExitCode": 137}, (-9, True)),
        ({"OOMKilled": False, "ExitCode": 3}, (3, False)),
        ({"ExitCode": 0}, (0, False)),
        ({}, (None, False)),
    ],
)
def test_exit_of_a_container_state(state: dict[str, object], expected: tuple[int | None, bool]) -> None:
    assert exit_of(state) == expected


def test_stats_figures() -> None:
    stats = {
        "cpu_stats": {"cpu_usage": {"total_usage": 300}, "system_cpu_usage": 2000, "online_cpus": 2},
        "precpu_stats": {"cpu_usage": {"total_usage": 100}, "system_cpu_usage": 1000},
        "memory_stats": {"usage": 5000, "stats": {"rss": 1234}},
    }
    assert cpu_percent(stats) == pytest.approx(40.0)
    assert resident_bytes(stats) == 1234
    assert resident_bytes({"memory_stats": {"usage": 5000, "stats": {"inactive_file": 1000}}}) == 4000
    assert cpu_percent({}) == 0.0


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ({"manifest.json": b"[]"}, "manifest.json lists no image"),
        ({"manifest.json": b'[{"Config": "c.json", "Layers": []}]'}, "archive has no c.json"),
        ({"manifest.json": b"{not json"}, "manifest.json:"),
        ({"oci-layout": b"{}", "index.json": b'{"manifests": []}'}, "index.json lists no manifest"),
        ({"oci-layout": b"{}", "index.json": b'{"manifests": [{"digest": "sha256:00"}]}'}, "no blob sha256:00"),
        ({"README": b"hi"}, "archive has no manifest.json"),
    ],
)
def test_bad_archives_are_refused_in_one_line(files: dict[str, bytes], says: str) -> None:
    with pytest.raises(ImageArchiveError, match=says.replace("{", r"\{")) as caught:
        read_image_archive(_tar(files))
    assert "\n" not in str(caught.value)


def test_a_docker_save_archive_is_read_with_layers_gzipped_and_the_rootfs_label() -> None:
    config = json.dumps({"os": "linux", "architecture": "arm64", "config": {"Cmd": ["x"]}}).encode()
    archive = _tar(
        {
            "c.json": config,
            "l/layer.tar": _tar({"f": b"1"}),
            "manifest.json": json.dumps([{"Config": "c.json", "Layers": ["l/layer.tar"]}]).encode(),
        }
    )
    image = read_image_archive(archive)
    assert image.platform == "linux/arm64"
    assert image.layers[0][:2] == b"\x1f\x8b"
    assert json.loads(image.config)["config"]["Labels"] == {"dev.zattera.rootfs": "full"}


@pytest.mark.parametrize(
    ("stamp", "since"),
    [
        ("2026-12-02T01:02:03.123456789Z", "1796173323.123456789"),
        ("2026-12-02T01:02:03.1Z", "1796173323.100000000"),
        ("2026-12-02T01:02:03Z", "1796173323.000000000"),
    ],
)
def test_since_is_the_cursors_instant_to_the_nanosecond(stamp: str, since: str) -> None:
    assert since_param(stamp) == since


def test_a_resumed_follower_skips_exactly_the_lines_of_that_instant_it_copied() -> None:
    # The flood stamped three lines at T; two were copied before the agent stopped: the third is new (it was
    # lost when the follower resumed a microsecond after T), and so is everything after.
    resume = Resume("T", 2)
    assert [resume.new(stamp) for stamp in ("T", "T", "T", "T+1", "T+1")] == [False, False, True, True, True]
    fresh = Resume("", 0)
    assert fresh.new("T")


@pytest.mark.parametrize(
    ("tenant", "labels", "key"),
    [
        ("E1", {LABEL_ASSIGNMENT: "A1"}, "env:E1"),  # instances of one environment share its user
        ("", {LABEL_ASSIGNMENT: "A1"}, "env:A1"),  # no tenant in the plan: the assignment's own
        ("", {}, "env:"),
    ],
)
def test_an_instance_runs_as_its_tenants_user(tenant: str, labels: dict[str, str], key: str) -> None:
    image = ContainerImage("ref", Path("/app"), tag="t")
    launch = Launch(["app"], image, {}, Path("/i"), LaunchPlan(tenant=tenant), labels)
    assert launch.tenant_key == key


async def test_the_docker_runtime_refuses_what_only_the_process_runtime_runs() -> None:
    launcher = DockerLauncher("unix:///nonexistent.sock", node_id="n1", base_image="b", pids_limit=0)
    try:
        for ref, why in [("", "the release has no image yet"), ("process:///app", "process:// images need")]:
            with pytest.raises(ImageError, match=why):
                await launcher.prepare(None, ref, Path("/i"), platform="linux/amd64")  # type: ignore[arg-type]
    finally:
        await launcher.close()
