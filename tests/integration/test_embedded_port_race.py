"""A port found free but taken before nats-server binds it (another process's connection got it) is chosen
again: the embedded server starts on the next one instead of failing the fixture that wanted it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import shared.embedded as embedded
from shared.embedded import EmbeddedNats


def test_a_port_taken_meanwhile_is_chosen_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or real())
    server = EmbeddedNats(data_dir=tmp_path / "nats")
    try:
        server.start()
        assert server.port != taken.getsockname()[1]
    finally:
        server.stop()
        taken.close()
