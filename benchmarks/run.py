"""``make bench``: run every benchmark under benchmarks/ and print one table.

Each ``benchmarks/<name>_bench.py`` exposes ``run(quick: bool) -> list[row]``. Quick mode is the
default; ``--full`` runs the large sizes. ``--only NAME`` runs a subset.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import Row, print_table, row

HERE = Path(__file__).resolve().parent


def discover() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*_bench.py"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--only", action="append", default=[], help="e.g. --only state_bench")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    names = [n for n in discover() if not args.only or n in args.only]
    rows: list[Row] = []
    failed: list[str] = []
    for name in names:
        started = time.perf_counter()
        print(f"running {name} …", flush=True)
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            rows += module.run(quick=not args.full)
        except Exception as exc:
            traceback.print_exc()
            rows.append(row(f"{name} FAILED: {exc}", float("nan"), ""))
            failed.append(name)
        print(f"  {name} done in {time.perf_counter() - started:.1f}s", flush=True)
    print_table("Zattera benchmarks" + (" (full)" if args.full else " (quick)"), rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
    if failed:  # the others still ran and are printed; the run as a whole is not a success
        sys.exit(f"benchmarks that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
