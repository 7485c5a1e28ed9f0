"""A real ACME server on loopback for the certificate tests: Debian's ``pebble`` with ``pebble-challtestsrv``
as its DNS (every name → 127.0.0.1), the directory served over TLS with a certificate made here, HTTP-01
validations sent to ``http_port`` (a real proxy's). ``PEBBLE_VA_NOSLEEP`` and ``PEBBLE_WFE_NONCEREJECT=0``
keep it fast and deterministic."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.embedded import free_port
from shared.security.tls import generate

PEBBLE = shutil.which("pebble") or "/usr/bin/pebble"
CHALLTESTSRV = shutil.which("pebble-challtestsrv") or "/usr/bin/pebble-challtestsrv"


@dataclass
class Pebble:
    directory_url: str
    ca_bundle: Path  # verifies the directory's own TLS
    management_url: str
    dns_management_url: str

    def root_pem(self) -> str:
        """The root pebble issues under (fresh per pebble run)."""
        context = ssl.create_default_context(cafile=str(self.ca_bundle))
        with urllib.request.urlopen(f"{self.management_url}/roots/0", context=context, timeout=5) as response:
            return str(response.read().decode())

    def resolve(self, host: str, address: str) -> None:
        """Point ``host`` at ``address`` in pebble's DNS."""
        body = json.dumps({"host": host, "addresses": [address]}).encode()
        request = urllib.request.Request(f"{self.dns_management_url}/add-a", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass


def _wait_listening(url: str, context: ssl.SSLContext | None, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            with urllib.request.urlopen(url, context=context, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # answering
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start (exit {proc.poll()})") from None
            time.sleep(0.05)


@contextmanager
def running_pebble(directory: Path, http_port: int) -> Iterator[Pebble]:
    directory.mkdir(parents=True, exist_ok=True)
    listener = generate(directory / "listener", ["localhost", "127.0.0.1"])  # pebble's own TLS
    dns_port, dns_mgmt, acme_port, mgmt_port, tls_port = (free_port() for _ in range(5))
    config = {
        "pebble": {
            "listenAddress": f"127.0.0.1:{acme_port}",
            "managementListenAddress": f"127.0.0.1:{mgmt_port}",
            "certificate": str(listener.cert),
            "privateKey": str(listener.key),
            "httpPort": http_port,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": False,
        }
    }
    (directory / "pebble.json").write_text(json.dumps(config))
    env = {"PATH": "/usr/bin:/bin", "PEBBLE_VA_NOSLEEP": "1", "PEBBLE_WFE_NONCEREJECT": "0"}
    log = (directory / "pebble.log").open("wb")
    dns = subprocess.Popen(
        [
            CHALLTESTSRV,
            "-dns01", f"127.0.0.1:{dns_port}",
            "-http01", "",
            "-https01", "",
            "-tlsalpn01", "",
            "-management", f"127.0.0.1:{dns_mgmt}",
            "-defaultIPv4", "127.0.0.1",
            "-defaultIPv6", "",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    ca = subprocess.Popen(
        [PEBBLE, "-config", str(directory / "pebble.json"), "-dnsserver", f"127.0.0.1:{dns_port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        context = ssl.create_default_context(cafile=str(listener.ca))
        _wait_listening(f"https://127.0.0.1:{acme_port}/dir", context, ca, "pebble")
        _wait_listening(f"http://127.0.0.1:{dns_mgmt}/", None, dns, "pebble-challtestsrv")
        yield Pebble(
            f"https://127.0.0.1:{acme_port}/dir",
            listener.ca,
            f"https://127.0.0.1:{mgmt_port}",
            f"http://127.0.0.1:{dns_mgmt}",
        )
    finally:
        for proc in (ca, dns):
            proc.terminate()
        for proc in (ca, dns):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
