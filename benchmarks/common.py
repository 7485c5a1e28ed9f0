"""Helpers shared by the benchmarks: an embedded server, percentiles, the result row and table."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shared.embedded import EmbeddedNats

Row = dict[str, Any]


def row(figure: str, value: float, unit: str, target: str = "", anchor: str = "") -> Row:
    return {"figure": figure, "value": value, "unit": unit, "target": target, "anchor": anchor}


def percentile(samples: Sequence[float], p: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = (len(ordered) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


@contextlib.contextmanager
def embedded_server(prefix: str = "zattera-bench-") -> Iterator[EmbeddedNats]:
    """A throwaway nats-server whose store is on the real disk (not tmpfs), as in production."""
    base = Path.home() / ".cache" / "zattera-bench"
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as tmp:
        server = EmbeddedNats(data_dir=Path(tmp) / "nats").start()
        try:
            yield server
        finally:
            server.stop()


def stop_up(proc: subprocess.Popen[bytes], data_dir: Path) -> None:
    """Stop a ``zattera up`` a benchmark started in its own process group (Ctrl-C, then SIGKILL after 30 s),
    and anything still running under its data dir."""
    from tests.e2e.cluster import kill_tree_under

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    kill_tree_under(data_dir, also_matching=str(data_dir))


async def listening(port: int, timeout: float = 30.0, poll: float = 0.002) -> None:
    """Until something accepts a connection on 127.0.0.1:``port`` (TimeoutError after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {port}") from None
            await asyncio.sleep(poll)


def format_value(value: float) -> str:
    if value != value:  # NaN
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:,.2f}"
    return f"{value:.4f}"


def print_table(title: str, rows: Sequence[Row]) -> None:
    table = Table(title=title)
    for column in ("figure", "measured", "target", "anchor"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(
            r["figure"], f"{format_value(float(r['value']))} {r['unit']}", r.get("target", ""), r.get("anchor", "")
        )
    Console().print(table)


def bench_main(title: str, run: Callable[[bool], list[Row]], doc: str | None, full_help: str) -> None:
    """The command line every benchmark shares: ``[--full] [--json]``, then one table."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help=full_help)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = run(not args.full)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print_table(title + (" (full)" if args.full else " (quick)"), rows)
