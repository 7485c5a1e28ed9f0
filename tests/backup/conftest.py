"""What the backup tests share: a real S3 API server (moto in server mode) on loopback, with boto3 pointed
at it through the environment as an operator's would be, and a bucket in it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

BUCKET = "zattera-backups"
ACCESS_KEY = "AKIABACKUPTEST000001"
SECRET_KEY = "backup-test-secret-key-not-in-argv"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The S3 server's endpoint; ``AWS_*`` set for this test; bucket :data:`BUCKET` created."""
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()
