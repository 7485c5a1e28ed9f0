"""A refused credential, a refused subject and a wrong address are told as such, at once: never as a cluster
that is down, never after the bounded waits meant for a server that is slow to answer."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from cli.main import app
from shared.connection import NotAuthorized, PermissionDenied, connect
from shared.embedded import free_port
from shared.natssettings import nats_settings
from shared.security.permissions import Role
from shared.subjects import STATE_STREAM
from tests.security.conftest import SecureCluster

PATIENCE = 30.0
"""The waits these failures used to sit out (connect timeouts, the CLI's bounded JetStream wait) are set to
this; each failure must come well before it."""


async def test_a_connection_without_credentials_is_refused_at_once_as_unauthorised(secure: SecureCluster) -> None:
    with pytest.raises(NotAuthorized, match=r"refused no credential .*authorization violation"):
        await asyncio.wait_for(connect(secure.url, connect_timeout=PATIENCE), PATIENCE / 3)


async def test_a_credential_refused_a_subject_fails_the_request_at_once_naming_both(secure: SecureCluster) -> None:
    creds = secure.creds(Role.PROXY, "edge-1")
    conn = await connect(secure.url, creds=creds, request_deadline=PATIENCE)
    try:
        with pytest.raises(PermissionDenied) as refused:
            await asyncio.wait_for(conn.js.stream_info(STATE_STREAM), PATIENCE / 3)
        text = str(refused.value)
        assert creds in text and "'edge-1'" in text
        assert f"may not publish to $JS.API.STREAM.INFO.{STATE_STREAM}" in text
    finally:
        await conn.close()


async def test_a_wrong_address_fails_once_every_server_was_tried_without_a_disconnect_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    refusing = f"nats://127.0.0.1:{free_port()}"  # nothing listens: refused at once
    with socket.socket() as silent:  # accepts, never speaks: the connect timeout per server
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        quiet = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ConnectionError, match="no NATS server reachable"):
            await asyncio.wait_for(connect(refusing, connect_timeout=PATIENCE, fail_fast=True), PATIENCE / 3)
        with pytest.raises(ConnectionError, match="no NATS server reachable"):
            await asyncio.wait_for(connect(quiet, connect_timeout=1, fail_fast=True), PATIENCE / 3)
    assert not [r for r in caplog.records if "disconnected" in r.getMessage()]


def test_the_cli_says_which_credential_may_not_do_what_and_which_one_it_needs(
    secure: SecureCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ZATTERA_CONFIG_DIR", str(tmp_path))  # no saved context

    def status(creds: str) -> Result:
        monkeypatch.setenv("ZATTERA_NATS_CREDS", creds)
        nats_settings.cache_clear()
        try:
            return CliRunner().invoke(app, ["--nats", secure.url, "status"])
        finally:
            nats_settings.cache_clear()

    plain = status("")
    assert plain.exit_code == 1
    assert "authorization violation" in plain.output and "operator credential" in plain.output
    proxy = secure.creds(Role.PROXY, "edge-2")
    wrong = status(proxy)
    assert wrong.exit_code == 1
    assert f"refused the credential {proxy}" in wrong.output and "may not publish to $JS.API." in wrong.output
    assert "cannot reach" not in wrong.output and "no answer" not in wrong.output
