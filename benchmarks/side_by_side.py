"""Our ingress and a hand-configured HAProxy under the same client loads, in alternating rounds.

Used by ``ingress_bench`` (the engine in this process, 1 and 10,000 envs) and ``ingress_up_bench`` (a real
``zattera up``). Each load runs against each HAProxy in turn, the order flipped every round (ours, hand;
hand, ours; …) so drift on the shared machine hits both alike. A round records the requests/s the client
got and the CPU time (user + system, ``/proc/<pid>/stat``) the HAProxy worker spent per answered request:
the figure the machine's other work moves least.

Loads (1 client thread, 32 connections):

* ``http`` — wrk, HTTP/1.1 keep-alive;
* ``tls`` — wrk over TLS, keep-alive;
* ``tls-resumed`` — wrk over TLS with ``Connection: close``: a new connection per request, the TLS session
  resumed (wrk keeps its session: HAProxy's ``SslFrontendSessionReuse_pct`` reads 100);
* ``tls-full`` — h2load ``--h1`` with ``Connection: close``: a new connection and a full handshake per
  request (h2load resumes nothing);
* ``h2`` — h2load, HTTP/2 over TLS (ALPN), 10 concurrent streams per connection.

The TLS server name (SNI) is the env's hostname: wrk gets it from the URL while a small script pins the
address to loopback; h2load from ``--connect-to``. With ``sni`` (``ingress_tls_bench``: 10,000 hosts with a
certificate each), each run gets another server name from that list — the same for every side within a
round — while the ``Host`` header (h2: ``:authority``) stays the env's: the certificate is picked among all
of them, the request routed to the one env that has a replica.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from benchmarks.common import Row, median, row
from services.proxy.haproxy_runtime import command

CONNECTIONS = 32
STREAMS = 10
PIN_TO_LOOPBACK = """-- connect to 127.0.0.1 whatever the URL's host (which stays the TLS server name)
wrk.resolve = function(host, service)
   wrk.addrs = wrk.lookup("127.0.0.1", service)
end
"""
LOADS = ("http", "tls", "tls-resumed", "tls-full", "h2")
COUNTED = frozenset({"tls-full"})
"""Loads run for a number of requests rather than a time."""
LABELS = {
    "http": "HTTP keep-alive",
    "tls": "HTTPS keep-alive",
    "tls-resumed": "HTTPS, new connection per request (session resumed)",
    "tls-full": "HTTPS, new connection per request (full handshake)",
    "h2": f"HTTP/2 over TLS ({CONNECTIONS} connections x {STREAMS} streams)",
}


@dataclass(frozen=True)
class Side:
    """One HAProxy under test: its listeners and the worker process to charge; ``companions``: other
    processes whose CPU is reported beside the worker's, per request (ours: the rest of ``zattera up``)."""

    name: str
    http_port: int
    tls_port: int
    pid: int
    companions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Run:
    requests: int
    seconds: float
    p50_ms: float
    failed: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class Sample:
    rate: float
    cpu_us: float
    p50_ms: float
    failed: int
    companion_us: float = 0.0
    """CPU per request of the side's companion processes (see :class:`Side`)."""


@dataclass
class Results:
    samples: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)

    def of(self, load: str, side: str) -> list[Sample]:
        return self.samples.get((load, side), [])


FORWARDED_HEADERS = (
    "    http-request set-header X-Forwarded-Proto %[ssl_fc,iif(https,http)]\n"
    "    http-request set-header X-Forwarded-Host %[req.hdr(host)]\n"
)
"""The forwarded headers an operator configures so that apps behind a hand-written HAProxy learn what
Zattera's ingress tells them (with ``option forwardfor``): client address, scheme and original host."""


def hand_config(
    directory: Path,
    hosts: Sequence[str],
    backend_addr: str,
    http_port: int,
    tls_port: int,
    certs: Sequence[Path],
    *,
    forwarded: bool = False,
) -> Path:
    """HAProxy as an operator would configure it by hand: one thread (as ours), every host in a map to one
    backend whose server is ``backend_addr``, and a TLS listener picking among ``certs`` (one PEM of chain
    and key each) by SNI, h2 and HTTP/1.1 by ALPN; defaults everywhere else. ``forwarded``: every request
    also gets ``X-Forwarded-For``, ``-Proto`` and ``-Host``, as Zattera's ingress sets them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hosts.map").write_text("".join(f"{host} be\n" for host in hosts))
    (directory / "certs.list").write_text("".join(f"{cert}\n" for cert in certs))
    config = directory / "hand.cfg"
    config.write_text(
        "global\n    nbthread 1\n"
        "defaults\n    mode http\n    option http-keep-alive\n    timeout connect 5s\n    timeout client 30s\n"
        "    timeout server 30s\n"
        + ("    option forwardfor\n" if forwarded else "")
        + f"frontend fe\n    bind 127.0.0.1:{http_port}\n"
        f"    bind 127.0.0.1:{tls_port} ssl crt-list {directory}/certs.list alpn h2,http/1.1\n"
        + (FORWARDED_HEADERS if forwarded else "")
        + f"    use_backend %[req.hdr(host),lower,map({directory}/hosts.map)]\n"
        f"backend be\n    server s1 {backend_addr}\n"
    )
    return config


@contextlib.contextmanager
def hand_haproxy(
    directory: Path,
    hosts: Sequence[str],
    backend_addr: str,
    certs: Sequence[Path],
    ports: tuple[int, int],
    *,
    forwarded: bool = False,
    name: str = "hand",
) -> Iterator[Side]:
    """:func:`hand_config` run (``haproxy -db``) until both its listeners accept connections."""
    config = hand_config(directory, hosts, backend_addr, ports[0], ports[1], certs, forwarded=forwarded)
    process = serving_process(["haproxy", "-db", "-f", str(config)])
    try:
        wait_listening(process, ports, 120)  # 10,000 certificates take a while to load
        yield Side(name, ports[0], ports[1], process.pid)
    finally:
        process.terminate()
        process.wait(30)


def serving_process(argv: list[str]) -> subprocess.Popen[bytes]:
    """A server under test in its own session, as the engine starts its HAProxy: with the kernel's
    autogroup scheduling (on by default), a server left in the bench's session would share one CPU share
    with the load generator, and lose to one in its own (2x fewer new TLS connections/s)."""
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def wait_listening(process: subprocess.Popen[bytes], ports: Sequence[int], timeout: float) -> None:
    """Until every port in ``ports`` accepts connections; fails if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while not all(_accepts(port) for port in ports):
        if process.poll() is not None:
            error = process.stderr.read().decode(errors="replace")[-2000:] if process.stderr else ""
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}: {error}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{process.args!r} did not listen on {list(ports)}")
        time.sleep(0.05)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def served_certificate(port: int, host: str) -> bytes:
    """The certificate (DER) a TLS listener on loopback serves for the server name ``host``."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    if der is None:
        raise RuntimeError(f"no certificate on port {port}")
    return der


def check_certificate(side: Side, host: str, pem: Path) -> None:
    """Fail unless ``side`` serves ``pem``'s certificate for ``host`` (not its fallback)."""
    wanted = x509.load_pem_x509_certificates(pem.read_bytes())[0].public_bytes(serialization.Encoding.DER)
    if served_certificate(side.tls_port, host) != wanted:
        raise RuntimeError(f"{side.name} does not serve {pem.name} for {host}")


async def haproxy_worker(stats_socket: Path) -> int:
    """The pid of the HAProxy worker answering on ``stats_socket`` (the process that serves, under a master)."""
    for line in (await command(stats_socket, "show info")).splitlines():
        if line.startswith("Pid:"):
            return int(line.split(":", 1)[1])
    raise RuntimeError(f"haproxy on {stats_socket} did not give its pid")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def companions_cpu(pids: Sequence[int]) -> float:
    """The CPU seconds of those of ``pids`` that still run (a short-lived one's are not counted)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


@contextlib.contextmanager
def pin_script() -> Iterator[Path]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="zattera-pin-") as script:
        script.write(PIN_TO_LOOPBACK)
        script.flush()
        yield Path(script.name)


def wrk(url: str, host: str, seconds: float, *, close: bool = False, script: Path | None = None) -> Run:
    """One wrk run (1 thread, :data:`CONNECTIONS` connections); ``close``: a new connection per request."""
    argv = ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s", "--latency", "-H", f"Host: {host}"]
    if close:
        argv += ["-H", "Connection: close"]
    if script is not None:
        argv += ["-s", str(script)]
    out = subprocess.run([*argv, url], capture_output=True, text=True, check=True).stdout
    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if done is None or done.group(1) == "0":
        raise RuntimeError(f"wrk {url}: no request answered: {out}")
    elapsed = float(done.group(2)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[done.group(3)]
    value, unit = re.search(r"50%\s+([\d.]+)(us|ms|s)", out).groups()  # type: ignore[union-attr]
    failed = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses:\s+(\d+)", out))
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errors:
        failed += sum(int(n) for n in errors.groups())
    p50 = float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    return Run(int(done.group(1)), elapsed, p50, failed)


def h2load(port: int, host: str, seconds: float, *, h1_close_requests: int = 0, sni: str = "") -> Run:
    """One h2load run over TLS to ``127.0.0.1:port`` with ``host`` as the server name and authority: HTTP/2
    with :data:`STREAMS` streams per connection for ``seconds``, or (``h1_close_requests``) that many HTTP/1.1
    requests with a new connection and full handshake each (h2load 1.52 never ends a timed run of those)."""
    argv = ["h2load", "-t1", f"-c{CONNECTIONS}", f"--connect-to=127.0.0.1:{port}"]
    if sni and sni != host:
        argv += ["-H", f":authority: {host}"]
    if h1_close_requests:
        argv += [f"-n{h1_close_requests}", "--h1", "-H", "connection: close"]
    else:
        argv += [f"-D{max(1, round(seconds))}", f"-m{STREAMS}"]
    out = subprocess.run(
        [*argv, f"https://{sni or host}/"], capture_output=True, text=True, check=True, timeout=600
    ).stdout
    finished = re.search(r"finished in ([\d.]+)(us|ms|s)", out)
    done = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed, (\d+) errored", out)
    if finished is None or done is None or done.group(1) == "0":
        raise RuntimeError(f"h2load {host} on {port}: no request answered: {out}")
    elapsed = float(finished.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[finished.group(2)]
    statuses = re.search(r"status codes: \d+ 2xx, \d+ 3xx, (\d+) 4xx, (\d+) 5xx", out)
    refused = int(statuses.group(1)) + int(statuses.group(2)) if statuses else 0  # h2load counts them succeeded
    return Run(int(done.group(1)), elapsed, float("nan"), int(done.group(2)) + int(done.group(3)) + refused)


def run_load(load: str, side: Side, host: str, seconds: float, script: Path, requests: int = 0, sni: str = "") -> Run:
    """One run of ``load``; ``requests``: how many a counted load (``tls-full``) sends; ``sni``: the TLS
    server name when not ``host``."""
    tls_url = f"https://{sni or host}:{side.tls_port}/"
    if load == "http":
        return wrk(f"http://127.0.0.1:{side.http_port}/", host, seconds)
    if load == "tls":
        return wrk(tls_url, host, seconds, script=script)
    if load == "tls-resumed":
        return wrk(tls_url, host, seconds, close=True, script=script)
    if load == "tls-full":
        return h2load(side.tls_port, host, seconds, h1_close_requests=requests or CONNECTIONS * 4, sni=sni)
    if load == "h2":
        return h2load(side.tls_port, host, seconds, sni=sni)
    raise ValueError(f"unknown load {load!r}")


def measure(
    sides: Sequence[Side],
    host: str,
    *,
    loads: Sequence[str] = LOADS,
    rounds: int,
    seconds: float,
    progress: Callable[[str], None] = lambda _: None,
    sni: Sequence[str] = (),
) -> Results:
    """``rounds`` alternating rounds of every load against every side (TLS loads need ``tls_port``);
    ``sni``: server names taken in turn, one per round and load (see the module)."""
    results = Results()
    names = itertools.cycle(sni) if sni else None
    with pin_script() as script:
        for load in loads:
            requests = 0
            if load in COUNTED:  # as many requests as the first side answers in ``seconds``, for every run
                probe = run_load(load, sides[0], host, seconds, script)
                requests = max(CONNECTIONS * 4, round(probe.rate * seconds))
            for index in range(rounds):
                order = list(sides) if index % 2 == 0 else list(reversed(sides))
                name = next(names) if names is not None else ""
                for side in order:
                    before = cpu_seconds(side.pid)
                    before_companions = companions_cpu(side.companions)
                    started = time.monotonic()
                    outcome = run_load(load, side, host, seconds, script, requests, name)
                    used = cpu_seconds(side.pid) - before
                    companions = companions_cpu(side.companions) - before_companions
                    per = 1e6 / outcome.requests if outcome.requests else float("nan")
                    sample = Sample(outcome.rate, used * per, outcome.p50_ms, outcome.failed, companions * per)
                    cpu_us = sample.cpu_us
                    results.samples.setdefault((load, side.name), []).append(sample)
                    progress(
                        f"{load} round {index + 1} {side.name}: {sample.rate:,.0f} req/s, {cpu_us:.1f} µs CPU/request "
                        f"({time.monotonic() - started:.1f} s)"
                    )
    return results


def _spread(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def rows(results: Results, scale: str, *, ours: str = "ours", hand: str = "hand") -> list[Row]:
    """Per load: both rates, our share of the hand-configured rate and the CPU-per-request ratio, with every
    round's figure in the anchor column."""
    out: list[Row] = []
    for load in LOADS:
        mine, theirs = results.of(load, ours), results.of(load, hand)
        if not mine or not theirs:
            continue
        label = f"{LABELS[load]}, {scale}"
        rate_ours, rate_hand = median([s.rate for s in mine]), median([s.rate for s in theirs])
        cpu_ours, cpu_hand = median([s.cpu_us for s in mine]), median([s.cpu_us for s in theirs])
        shares = [100 * a.rate / b.rate for a, b in zip(mine, theirs, strict=False) if b.rate]
        failed = sum(s.failed for s in mine) + sum(s.failed for s in theirs)
        rates_ours = "rounds: " + _spread([s.rate for s in mine])
        rates_hand = "rounds: " + _spread([s.rate for s in theirs])
        per_round = "per round: " + _spread(shares, "{:.0f} %") + (f"; {failed} failed" if failed else "")
        cpu = (
            f"ours {cpu_ours:.1f} µs ({_spread([s.cpu_us for s in mine], '{:.1f}')}), "
            f"hand {cpu_hand:.1f} µs ({_spread([s.cpu_us for s in theirs], '{:.1f}')})"
        )
        out += [
            row(f"{label}: our ingress, req/s", rate_ours, "req/s", "", rates_ours),
            row(f"{label}: hand-configured HAProxy, req/s", rate_hand, "req/s", "", rates_hand),
            row(f"{label}: share of hand-configured HAProxy", 100 * rate_ours / rate_hand, "%", "≥ 90 %", per_round),
            row(f"{label}: HAProxy CPU per request, ours / hand", cpu_ours / cpu_hand, "x", "≤ 1.2", cpu),
        ]
        if any(s.companion_us for s in mine):
            total = [s.cpu_us + s.companion_us for s in mine]
            out.append(
                row(
                    f"{label}: CPU per request of ours with its companions (see the bench), ours / hand",
                    median(total) / cpu_hand,
                    "x",
                    "",
                    f"ours {median(total):.1f} µs (HAProxy + companions: {_spread(total, '{:.1f}')}; companions "
                    f"alone {_spread([s.companion_us for s in mine], '{:.1f}')})",
                )
            )
    return out
