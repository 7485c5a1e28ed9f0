"""The sandbox's decisions without running one: which node may run apps how, the uid table, the bwrap command
line, exit codes, and the data directory's layout and its migration."""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from cli.layout import DataLayout
from services.agent.sandbox import (
    CONTAINER,
    NONE,
    SANDBOX,
    SETPRIV,
    Confinement,
    IsolationRefused,
    Sandbox,
    Support,
    decide_isolation,
    exit_status,
)
from services.agent.sandbox_users import UidTable

CAN = Support(bwrap="/usr/bin/bwrap", nsenter="/usr/bin/nsenter")
CANNOT = Support(problem="bubblewrap is not installed")


@pytest.mark.parametrize(
    ("runtime", "mode", "support", "secured", "allowed", "expected"),
    [
        ("process", "auto", CAN, False, False, SANDBOX),
        ("process", "auto", CAN, True, False, SANDBOX),
        ("process", "auto", CANNOT, False, False, NONE),  # an open cluster runs them, and says so
        ("process", "auto", CANNOT, True, False, "refused"),  # a secured one does not…
        ("process", "auto", CANNOT, True, True, NONE),  # …unless the operator accepts it
        ("process", "on", CANNOT, False, True, "refused"),  # required: never unisolated
        ("process", "off", CAN, False, False, NONE),
        ("process", "off", CAN, True, False, "refused"),
        ("process", "off", CAN, True, True, NONE),
        ("docker", "auto", CANNOT, True, False, CONTAINER),
    ],
)
def test_which_node_runs_apps_how(
    runtime: str, mode: str, support: Support, secured: bool, allowed: bool, expected: str
) -> None:
    decide = {"runtime": runtime, "mode": mode, "support": support, "secured": secured, "allow_unisolated": allowed}
    if expected == "refused":
        with pytest.raises(IsolationRefused) as refused:
            decide_isolation(**decide)  # type: ignore[arg-type]
        assert "--allow-unisolated-apps" in str(refused.value) or "ZATTERA_AGENT_SANDBOX=on" in str(refused.value)
        return
    isolation = decide_isolation(**decide)  # type: ignore[arg-type]
    assert isolation.kind == expected
    assert bool(isolation.problem) == (expected == NONE)
    if expected == NONE:
        assert isolation.describe().startswith("NOT isolated")


def test_uids_are_derived_from_the_key_kept_across_restarts_and_skip_taken_ones(tmp_path: Path) -> None:
    table = UidTable(tmp_path, base=0x70000000, count=4)
    first = table.uid("env:E1")
    assert 0x70000000 <= first < 0x70000004
    assert table.uid("env:E1") == first
    others = {table.uid(f"env:E{i}") for i in range(2, 5)}
    assert first not in others and len(others) == 3  # collisions probe on: four keys, four uids
    with pytest.raises(Exception, match="no free uid"):
        table.uid("env:E5")
    assert stat.S_IMODE((tmp_path / "uids.json").stat().st_mode) == 0o600
    again = UidTable(tmp_path, base=0x70000000, count=4)
    assert again.uid("env:E1") == first  # a restarted agent: the same uid (volumes stay its own)
    again.retain({"env:E1"}, prefix="env:")
    assert again.keys() == {"env:E1"}
    assert json.loads((tmp_path / "uids.json").read_text()) == {"env:E1": first}


def test_a_uid_the_system_names_or_a_process_runs_as_is_never_handed_out(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="no free uid"):
        UidTable(tmp_path, base=0, count=1).uid("env:E1")  # uid 0: root's, named and running
    for i in range(10):
        with pytest.raises(KeyError):
            pwd.getpwuid(UidTable(tmp_path / str(i), base=0, count=70000).uid(f"env:E{i}"))
    busy = 0x7A000000
    sleeper = subprocess.Popen(["sleep", "30"], user=busy, group=busy, extra_groups=[])  # another agent's app
    try:
        assert UidTable(tmp_path / "busy", base=busy, count=2).uid("env:E1") == busy + 1
    finally:
        sleeper.kill()
        sleeper.wait()


def test_exit_codes_of_a_death_by_signal_are_the_bare_process_ones() -> None:
    assert [exit_status(c) for c in (0, 3, 137, 143, 255, None)] == [0, 3, -9, -15, 255, None]


def _sandbox(tmp_path: Path, hidden: Path) -> Sandbox:
    return Sandbox(CAN, UidTable(tmp_path / "uids", base=0x70000000, count=16), read_only=(), hidden=(hidden,))


def test_the_command_line_shows_only_what_is_named_and_drops_to_the_user(tmp_path: Path) -> None:
    data = tmp_path / "data"
    rootfs = data / "instances" / "a1" / "rootfs"
    volume = data / "volumes" / "v1"
    c = Confinement(uid=0x70000001, workdir=rootfs, writable=(volume, rootfs))
    wrapped = _sandbox(tmp_path, data).wrap(c, ["python3", "app.py"], {"PATH": "/usr/bin", "HOME": os.environ["HOME"]})
    try:
        argv = wrapped.argv
        assert "--unshare-pid" in argv and "--die-with-parent" not in argv  # instances outlive the agent
        binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
        assert binds == [str(rootfs), str(volume)] or binds == [str(volume), str(rootfs)]
        assert str(data) not in [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--tmpfs")]
        tail = argv[argv.index("--") + 1 :]
        assert tail[0] == SETPRIV
        assert {"--reuid=1879048193", "--regid=1879048193", "--clear-groups", "--bounding-set=-all"} <= set(tail)
        assert "--no-new-privs" in tail and tail[-2:] == ["python3", "app.py"]
        assert argv[argv.index("--chdir") + 1] == str(rootfs)
        assert wrapped.env["HOME"] == str(rootfs) and wrapped.env["USER"] == "zattera-1879048193"
        passwd = os.pread(wrapped.fds[0], 1 << 20, 0).decode()
        assert passwd.endswith(f"zattera-1879048193:x:1879048193:1879048193:Zattera app:{rootfs}:/bin/sh\n")
    finally:
        wrapped.close()


def test_the_agents_data_inside_a_shown_directory_is_covered_before_deeper_paths_are_bound(tmp_path: Path) -> None:
    """A ``process://`` image's directory that holds the agent's data dir: the data dir is covered (empty),
    the instance's own volume inside it bound again on top."""
    project = tmp_path / "project"
    data = project / "agent"
    volume = data / "volumes" / "v1"
    c = Confinement(uid=0x70000002, workdir=project, writable=(project, volume), die_with_parent=True)
    wrapped = _sandbox(tmp_path, data).wrap(c, ["true"], {})
    wrapped.close()
    argv = wrapped.argv
    assert "--die-with-parent" in argv
    order = [(a, argv[i + 1]) for i, a in enumerate(argv) if a in ("--bind", "--tmpfs") and argv[i + 1] != "/tmp"]
    order = [pair for pair in order if pair[1] != "/dev/shm"]
    assert order == [("--bind", str(project)), ("--tmpfs", str(data)), ("--bind", str(volume))]


def test_a_previous_layout_is_moved_apart_once(tmp_path: Path) -> None:
    for name in ("nats/jetstream", "security/keys", "security/creds", "secrets", "certs", "agent/instances"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "security" / "keys" / "operator.nk").write_text("SEED")
    (tmp_path / "security" / "creds" / "builder-local.creds").write_text("CREDS")
    (tmp_path / "security" / "creds" / "operator.creds").write_text("OPS")
    layout = DataLayout(tmp_path)

    done = layout.migrate()

    assert (tmp_path / "control" / "security" / "keys" / "operator.nk").read_text() == "SEED"
    assert (tmp_path / "control" / "nats" / "jetstream").is_dir()
    assert (tmp_path / "control" / "secrets").is_dir() and (tmp_path / "control" / "certs").is_dir()
    assert not (tmp_path / "security").exists() and not (tmp_path / "nats").exists()
    assert (tmp_path / "control" / "security" / "creds" / "operator.creds").exists()
    assert not (tmp_path / "control" / "security" / "creds" / "builder-local.creds").exists()
    assert (tmp_path / "agent" / "node.creds").read_text() == "CREDS"  # the node's own, same identity
    assert (tmp_path / "agent" / "instances").is_dir()  # the agent's place already
    assert len(done) == 5 and any("builder-local" in line for line in done)
    assert layout.migrate() == []  # idempotent
    layout.make()
    for directory in (tmp_path, layout.control, layout.agent, layout.proxy, layout.logs):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_an_entry_at_both_places_is_left_alone_and_said_so(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "control" / "secrets").mkdir(parents=True)
    done = DataLayout(tmp_path).migrate()
    assert (tmp_path / "secrets").is_dir() and len(done) == 1 and "left in place" in done[0]


def test_nodes_list_says_how_each_node_isolates_its_apps() -> None:
    from zattera.v1 import types_pb2 as pb

    from cli.nodes_cmds import isolation_text

    assert isolation_text(pb.Node(isolation="sandbox")) == "sandbox"
    assert isolation_text(pb.Node(isolation="none", isolation_problem="bubblewrap is not installed")) == (
        "none (bubblewrap is not installed)"
    )
    assert isolation_text(pb.Node()) == "?"  # an agent from before the field


def test_a_volume_whose_id_would_name_a_path_outside_the_volumes_never_starts(tmp_path: Path) -> None:
    """Its directory would be mounted into the instance (and given to its user): ``../../run`` is the Docker
    socket's, ``..`` the agent's data."""
    from zattera.v1 import types_pb2 as pb

    from services.agent.instance_env import resolve_volumes
    from shared import keys as K
    from tests.memory_state import MemoryState

    rel = pb.Release(environment_id="E1", project_id="P1")
    rel.service.stateful = True
    rel.service.volumes.add(volume_name="data", mount_path="/data")
    a = pb.Assignment(node_id="n1", environment_id="E1", project_id="P1")
    a.meta.id = "A1"
    for volume_id, blocked in (("V1", ""), ("../../run", "volume data: volume id"), ("..", "volume data: volume id")):
        volume = pb.Volume(project_id="P1", environment_id="E1", name="data", node_id="n1")
        volume.meta.id = volume_id
        volume.lease.node_id, volume.lease.assignment_id = "n1", "A1"
        volume.lease.expires_at.FromSeconds(2_000_000_000)
        state = MemoryState()
        state.write(K.volume("V-key"), volume)
        paths, why = resolve_volumes(state.store, a, rel, tmp_path / "volumes", 1_000_000_000.0)
        assert why.startswith(blocked) if blocked else paths == {"data": tmp_path / "volumes" / "V1"}, why
        if blocked:
            assert paths == {}


def test_an_image_whose_working_directory_leaves_its_root_filesystem_is_refused(tmp_path: Path) -> None:
    """The working directory is what the sandbox shows the app read-write: never the agent's data dir."""
    from services.agent.images import ImageError, _parse_config

    rootfs = tmp_path / "instances" / "a1" / "rootfs"
    (rootfs / "app").mkdir(parents=True)
    assert _parse_config("r", rootfs, json.dumps({"config": {"WorkingDir": "/app"}}).encode()).workdir == rootfs / "app"
    for escaping in ("../../..", "/app/../../../.."):
        with pytest.raises(ImageError, match="leaves the image's root filesystem"):
            _parse_config("r", rootfs, json.dumps({"config": {"WorkingDir": escaping}}).encode())
