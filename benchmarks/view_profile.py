"""The slowest path found, profiled: a state view loading 30,000 assignments.

Run: ``python -m benchmarks.view_profile`` — loads the same bucket twice in one run, once with
nats-py's own header parser (before) and once with the replacement installed by ``shared.connection``
(after), prints both rates and writes a pyinstrument profile of each to ``.zattera/profiles/``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from nats.aio.client import Client as NATS
from pyinstrument import Profiler

from benchmarks.common import Row, embedded_server, print_table, row
from benchmarks.state_bench import _fill
from shared import connection
from shared.connection import connect
from shared.state.feed import StateView

ORIGINAL_PARSER = connection.ORIGINAL_HEADER_PARSER


async def _load(url: str) -> tuple[int, float]:
    conn = await connect(url, name="profile")
    view = StateView(conn, name="profile")
    started = time.perf_counter()
    await view.start(timeout=300)
    elapsed = time.perf_counter() - started
    count = view.applied
    await view.stop()
    await conn.close()
    return count, elapsed


def _measure(url: str, parser: object, label: str, out: Path | None) -> Row:
    NATS._parse_header_lines = parser  # type: ignore[method-assign]
    profiler = Profiler(interval=0.001) if out else None
    if profiler:
        profiler.start()
    count, elapsed = asyncio.run(_load(url))
    if profiler:
        profiler.stop()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(profiler.output_text(unicode=True, color=False))
    return row(f"view initial load, {label}", count / elapsed, "changes/s", ">= 20,000", "")


def run(quick: bool = True, profile_dir: Path | None = None) -> list[Row]:
    count = 30_000 if quick else 100_000
    patched = NATS.__dict__["_parse_header_lines"]
    rows = []
    with embedded_server() as server:
        asyncio.run(_fill(server.url, count))
        try:
            for label, parser in (
                ("nats-py header parser (before)", ORIGINAL_PARSER),
                ("replacement parser (after)", patched),
            ):
                name = "before" if "before" in label else "after"
                rows.append(
                    _measure(server.url, parser, label, profile_dir / f"view-{name}.txt" if profile_dir else None)
                )
        finally:
            NATS._parse_header_lines = patched  # type: ignore[method-assign]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--profile-dir", type=Path, default=Path(".zattera/profiles"))
    args = parser.parse_args()
    print_table("view load: before / after", run(quick=not args.full, profile_dir=args.profile_dir))


if __name__ == "__main__":
    main()
