"""How long a plain read takes from the shell: ``zattera status``, ``zattera ps`` (and ``--version``, which
needs no cluster), end to end, as an operator runs them.

Run: ``python -m benchmarks.cli_startup_bench [--full] [--json] [--root DIR] [--imports]`` (also part of
``make bench``).

A real ``zattera up --no-node`` (embedded NATS and the control plane; no agent or proxy, so nothing runs but
the env is there) on its own data dir and free ports, with the hello example applied. Each command is then run
as a new process, one after the other (quick: 5 rounds; full: 20), commands alternating: wall time (median,
min, max) and the CPU time the process used (user + system, from the kernel's accounting of the child: robust
on a busy machine where wall time is not). ``--root DIR`` runs another tree's CLI (e.g. an export of main) on
the same cluster, for A/B rounds. ``--imports`` prints the import time of ``zattera status`` by top-level
package (``python -X importtime``).

Target: a plain read (``status``, ``ps``) under 0.5 s (issue 33); it was 1.2–1.5 s. A plain read runs without
typer (``cli/main.py`` ``READS``); ``--version`` goes through typer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Row, median, print_table, row, stop_up
from shared.embedded import free_port
from tests.e2e.cluster import ROOT

COMMANDS = {"status": ["status"], "ps": ["ps"], "--version": ["--version"]}
TARGET = 0.5


def cli(root: Path) -> list[str]:
    """The `zattera` command of the tree at ``root`` (run with ``root`` as its working directory: its ``cli``
    package comes first on the path)."""
    return [sys.executable, "-c", "from cli.main import main; main()"]


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[-1]} failed ({done.returncode}): {done.stderr.decode(errors='replace')}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def import_breakdown(root: Path, env: dict[str, str]) -> dict[str, float]:
    """Milliseconds of import time (self) by top-level package, for running ``zattera status``."""
    argv = [sys.executable, "-X", "importtime", *cli(root)[1:], "status"]
    err = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    totals: dict[str, float] = collections.defaultdict(float)
    for line in err.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if match:
            totals[match.group(2).split(".")[0]] += int(match.group(1)) / 1000
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


class Up:
    """``zattera up --no-node`` in its own process group, with the hello example applied."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.url = f"nats://127.0.0.1:{free_port()}"
        # Bytecode is written (as an installed CLI has it): PYTHONDONTWRITEBYTECODE would compile every module
        # of every run from source.
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_") and k != "PYTHONDONTWRITEBYTECODE"
        }
        self.env |= {"OTEL_TRACES_EXPORTER": "none", "ZATTERA_CONSOLE_PORT": str(free_port())}
        port = self.url.rsplit(":", 1)[1]
        argv = [*cli(ROOT), "up", "--no-node", "--data-dir", str(data_dir), "--port", port, "--metrics-port", "0"]
        data_dir.mkdir(parents=True)
        with open(data_dir.parent / "up.out", "wb") as sink:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.cli_env = {**self.env, "ZATTERA_NATS_URL": self.url, "ZATTERA_CONFIG_DIR": str(data_dir / "cli")}

    def ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        apply = [*cli(ROOT), "apps", "apply", str(ROOT / "examples" / "hello" / "zattera.toml")]
        while subprocess.run(apply, cwd=ROOT, env=self.cli_env, capture_output=True).returncode != 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"zattera up did not come up: {(self.data_dir.parent / 'up.out').read_text()}")
            time.sleep(0.5)

    def stop(self) -> None:
        stop_up(self.proc, self.data_dir)


def measure(up: Up, roots: dict[str, Path], rounds: int) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Per (tree, command): (wall, CPU) of each round; trees and commands alternate within a round."""
    samples: dict[tuple[str, str], list[tuple[float, float]]] = collections.defaultdict(list)
    for args in COMMANDS.values():  # one warm-up each (the page cache; not counted)
        for root in roots.values():
            timed([*cli(root), *args], root, up.cli_env)
    for _ in range(rounds):
        for command, args in COMMANDS.items():
            for name, root in roots.items():
                samples[(name, command)].append(timed([*cli(root), *args], root, up.cli_env))
    return samples


def run(quick: bool = True, roots: dict[str, Path] | None = None, imports: bool = False) -> list[Row]:
    roots = roots or {"this tree": ROOT}
    with tempfile.TemporaryDirectory(prefix="zattera-cli-startup-") as tmp:
        up = Up(Path(tmp) / "data")
        try:
            up.ready()
            for name, root in roots.items() if imports else ():
                top = list(import_breakdown(root, up.cli_env).items())[:20]
                print(name, json.dumps({k: round(v) for k, v in top}))
            samples = measure(up, roots, 5 if quick else 20)
        finally:
            up.stop()
    rows = []
    for (name, command), runs in samples.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        label = f"zattera {command}" + (f" ({name})" if len(roots) > 1 else "")
        target = f"< {TARGET} s" if command in ("status", "ps") else ""
        spread = f"min {min(walls):.2f}, max {max(walls):.2f}"
        rows.append(row(f"{label}, wall median ({spread})", median(walls), "s", target, "issue 33: 1.2–1.5 s"))
        cpu_spread = f"min {min(cpus):.2f}, max {max(cpus):.2f}"
        rows.append(row(f"{label}, CPU (user + system) median ({cpu_spread})", median(cpus), "s"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="20 rounds")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--root", type=Path, help="also run the CLI of this tree (A/B, alternating)")
    parser.add_argument("--imports", action="store_true", help="print the import time of `status` by package")
    args = parser.parse_args()
    roots = {"this tree": ROOT, **({"other": args.root.resolve()} if args.root else {})}
    rows = run(not args.full, roots, args.imports)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print_table("CLI start-up" + (" (full)" if args.full else " (quick)"), rows)


if __name__ == "__main__":
    main()
