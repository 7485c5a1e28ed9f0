"""Metrics: OpenTelemetry instruments, exported on a Prometheus endpoint when a metrics port is given.

Every process (each service, the agent, the proxy) takes ``--metrics-port N`` (or ``ZATTERA_METRICS_PORT``;
0 = off, the default) and ``ZATTERA_METRICS_HOST`` (default 127.0.0.1). With a port, :func:`serve_metrics`
installs a meter provider whose reader is the Prometheus exporter and serves ``GET /metrics`` on its own
thread; without one the OpenTelemetry API stays a no-op, so instruments cost next to nothing.

Instruments are declared at import time (:class:`shared.telemetry.Instrument`) and made from the global meter
at their first use (the API hands out proxies that start recording once the provider is installed). Labels
are bounded by construction: loop names, env ids, assignment ids of one node, status classes — never request
paths or hosts. The catalogue is in docs/observability.md.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from shared.telemetry import Instrument, meter

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import Histogram

# The SDK and prometheus_client are imported when a process serves or records metrics (services with a
# metrics port, the proxy); the API when an instrument is first used (shared.telemetry.Instrument): a CLI
# read loads none of them.

log = logging.getLogger(__name__)

_serving: int | None = None

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds: from a local 1 ms hop to a 30 s slow request (a held cold start lands in the top buckets)."""

# Services: the leader loops and their fenced writes (shared/loop.py, shared/txn.py, shared/lease.py).
loop_pass_duration = Instrument(
    "histogram",
    "zattera.loop.pass.duration",
    unit="s",
    description="duration of one leader-loop pass (read the view, decide, commit)",
    explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
)
decisions = Instrument(
    "counter", "zattera.decisions", description="transactions (decisions) committed, by the loop that decided them"
)
commit_conflicts = Instrument(
    "counter",
    "zattera.commit.conflicts",
    description="transactions refused because a key or the lease changed since the decision (nothing written)",
)
lease_terms = Instrument("counter", "zattera.lease.terms", description="leadership terms won, by loop")
leases_held = Instrument("up_down_counter", "zattera.lease.held", description="1 while this process leads the loop")

# Proxy: one histogram point per request, through prometheus_client directly: its observe costs ~3 µs
# where the OpenTelemetry SDK's histogram record costs ~11-17 µs on this machine (benchmarks/proxy_bench.py).
# It lands in the same registry the OpenTelemetry exporter serves, so the proxy still has one /metrics.
# Its _count is the request counter.
_proxy_request_duration: Histogram | None = None


def proxy_request_duration() -> Histogram:
    """The proxy's request histogram (created once, in the default registry, by its first user)."""
    global _proxy_request_duration
    if _proxy_request_duration is None:
        from prometheus_client import Histogram

        _proxy_request_duration = Histogram(
            "zattera_proxy_request_duration_seconds",
            "requests answered by the proxy, by env id and status class, with their latency",
            ["env", "status_class"],
            buckets=LATENCY_BUCKETS,
        )
    return _proxy_request_duration


NO_ENV = "none"
"""The env label of a request that matched no route."""


class RequestSeries:
    """The proxy's request histogram, its series cached per (env id, status // 100): one dict lookup per
    request instead of a ``labels()`` call."""

    def __init__(self) -> None:
        self._histogram = proxy_request_duration()
        self._series: dict[tuple[str, int], Histogram] = {}

    def observe(self, env_id: str, status: int, seconds: float) -> None:
        key = (env_id or NO_ENV, status // 100)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self._histogram.labels(key[0], status_class(status))
        series.observe(seconds)


def status_class(status: int) -> str:
    """200 → "2xx" (five values at most: the label stays bounded)."""
    return f"{min(max(status // 100, 1), 5)}xx"


def writer_label(loop: str) -> dict[str, str]:
    """The ``loop`` label of a write: the leader loop's name, or "unfenced" (CLI, activator, agents)."""
    return {"loop": loop or "unfenced"}


def observe_gauges(
    name: str, unit: str, description: str, read: Callable[[], Iterable[tuple[float, dict[str, str]]]]
) -> None:
    """An observable gauge whose values ``read()`` returns at each scrape (value, labels)."""

    from opentelemetry.metrics import Observation

    def callback(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value, labels) for value, labels in read()]

    meter().create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (default: $ZATTERA_METRICS_PORT; 0 = off)",
    )


def serve_metrics(service_name: str, port: int, host: str = "127.0.0.1") -> int | None:
    """Install the Prometheus-exporting meter provider and serve /metrics on ``host:port`` (once per
    process). Returns the port served, None when metrics are off (``port`` 0)."""
    global _serving
    if port <= 0:
        return None
    if _serving is not None:
        return _serving
    from opentelemetry import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import start_http_server

    reader = PrometheusMetricReader()
    provider = MeterProvider(
        resource=Resource.create({"service.name": service_name}),
        metric_readers=[reader],
        exemplar_filter=AlwaysOffExemplarFilter(),  # no exemplars are exported; skip their cost per record
    )
    metrics.set_meter_provider(provider)
    start_http_server(port, addr=host)
    _serving = port
    log.info("%s: metrics on http://%s:%d/metrics", service_name, host, port)
    return port


def use_in_memory_reader() -> InMemoryMetricReader:
    """For tests: a provider whose metrics are read in process (no endpoint); once per process."""
    global _serving
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    _serving = 0
    return reader


def metrics_port(argument: int | None, setting: int) -> int:
    """The ``--metrics-port`` flag, else the setting."""
    return setting if argument is None else argument


def enabled() -> bool:
    return _serving is not None
