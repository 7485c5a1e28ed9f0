"""Content-defined chunking of a volume's tar stream with FastCDC: unchanged data cuts into the same chunks,
so a new snapshot stores only what changed.

The native core is ``pyfastcdc`` (Cython; a port of fastcdc-rs' FastCDC 2020, cutting without the
GIL). Its pure-Python fallback would be ~200x slower, so importing this module fails loudly when the
compiled extension is missing instead of silently crawling.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from pyfastcdc import FastCDC, NormalizedChunking

if not FastCDC.__module__.startswith("pyfastcdc.cy"):
    raise ImportError("pyfastcdc's compiled extension is missing (pure-Python fallback is far too slow)")

NORMALIZATION_LEVEL: NormalizedChunking = 2
GEAR_SEED = 0


@dataclass(frozen=True, slots=True)
class ChunkParams:
    """Chunk sizes (avg 1 MiB, min 256 KiB, max 4 MiB: one NATS message at most, :mod:`shared.snapshots.store`)."""

    avg: int = 1 << 20
    min: int = 1 << 18
    max: int = 1 << 22

    def __post_init__(self) -> None:
        if not self.min <= self.avg <= self.max:
            raise ValueError(f"chunk sizes must satisfy min <= avg <= max, got {self}")


TEST_PARAMS = ChunkParams(avg=4 << 10, min=1 << 10, max=16 << 10)


def chunker(params: ChunkParams) -> FastCDC:
    return FastCDC(
        params.avg,
        min_size=params.min,
        max_size=params.max,
        normalized_chunking=NORMALIZATION_LEVEL,
        seed=GEAR_SEED,
    )


def chunks(stream: BinaryIO, params: ChunkParams) -> Iterator[bytes]:
    """Yield the stream's chunks in order (each copied: the chunker reuses its buffer)."""
    for chunk in chunker(params).cut_stream(stream):
        yield bytes(chunk.data)


def chunk_lengths(data: bytes, params: ChunkParams) -> list[int]:
    return [c.length for c in chunker(params).cut_buf(data)]
