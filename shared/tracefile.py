"""A span exporter that appends finished spans as JSON lines to a file (``OTEL_TRACES_EXPORTER=file``).

Used by end-to-end tests and demos to follow one deployment across processes without a collector.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            parent = s.parent
            lines.append(
                json.dumps(
                    {
                        "name": s.name,
                        "trace_id": format(ctx.trace_id, "032x") if ctx else "",
                        "span_id": format(ctx.span_id, "016x") if ctx else "",
                        "parent_id": format(parent.span_id, "016x") if parent else "",
                        "service": s.resource.attributes.get("service.name", ""),
                        "start": s.start_time,
                        "end": s.end_time,
                        "attributes": {k: str(v) for k, v in (s.attributes or {}).items()},
                    }
                )
            )
        with self._lock, open(self._path, "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None
