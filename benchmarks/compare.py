"""Before and after, side by side in one run: the same benchmarks on two revisions, alternating.

    python -m benchmarks.compare --before 2fe2bf8 --only state_bench --only placement_bench --rounds 2

A refactor promises unchanged behaviour and speed (issue 22: every benchmark within 5 %). Timing two
revisions in separate runs compares two machines' moods; here each round runs every chosen benchmark on
the old revision and then on the new one, so both see the same load. The old revision is checked out
into a temporary git worktree and run with this checkout's interpreter, its own source first on the path.
Each figure's median over the rounds is printed with the change in per cent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.common import format_value, median

HERE = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Compared:
    figure: str
    before: float
    after: float
    unit: str

    @property
    def change_pct(self) -> float:
        return (self.after - self.before) / self.before * 100 if self.before else float("nan")


@contextmanager
def checkout(revision: str) -> Iterator[Path]:
    """The revision in a temporary worktree of this repository, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="zattera-compare-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision], cwd=HERE, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=HERE, check=False)


def run_benchmarks(tree: Path, names: list[str], *, full: bool) -> dict[str, tuple[float, str]]:
    """Run the named benchmarks (quick mode, or the large sizes with ``full``) from ``tree``; figure → (value, unit)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "benchmarks.run", "--json", out.name, *(["--full"] if full else [])]
        for name in names:
            command += ["--only", name]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "proto")])}
        subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(Path(out.name).read_text())
    return {r["figure"]: (float(r["value"]), r["unit"]) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the old revision (a commit, tag or branch)")
    parser.add_argument("--only", action="append", required=True, help="a benchmark module, e.g. state_bench")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="the large sizes (benchmarks.run --full)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = parser.parse_args()
    before: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    units: dict[str, str] = {}
    with checkout(args.before) as old:
        for round_number in range(1, args.rounds + 1):
            for label, tree, samples in (("before", old, before), ("after", HERE, after)):
                print(f"round {round_number}: {label}", file=sys.stderr, flush=True)
                for figure, (value, unit) in run_benchmarks(tree, args.only, full=args.full).items():
                    samples.setdefault(figure, []).append(value)
                    units[figure] = unit
    rows = [
        Compared(figure, median(before.get(figure, [])), median(values), units[figure])
        for figure, values in after.items()
    ]
    if args.json:
        print(json.dumps([dataclasses.asdict(r) | {"change_pct": r.change_pct} for r in rows], indent=2))
        return
    mode = "full" if args.full else "quick"
    table = Table(title=f"{args.before} → working tree, {mode} mode, median of {args.rounds} rounds")
    for column in ("figure", "before", "after", "change"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(
            r.figure,
            f"{format_value(r.before)} {r.unit}",
            f"{format_value(r.after)} {r.unit}",
            f"{r.change_pct:+.1f} %",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
