"""Stream creation asked again on a fresh cluster's transient refusals (shared.provisioning.until_placed)."""

from __future__ import annotations

import nats.errors
import pytest
from nats.js.errors import APIError

from shared.provisioning import NO_PEERS_FOR_PLACEMENT, STORE_NOT_CREATED, until_placed


@pytest.mark.parametrize("err_code", [NO_PEERS_FOR_PLACEMENT, STORE_NOT_CREATED])
async def test_a_transient_refusal_is_asked_again(err_code: int) -> None:
    calls: list[int] = []

    async def create() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise APIError(code=500, err_code=err_code, description="not yet")
        return "created"

    assert await until_placed(create, "stream S") == "created" and len(calls) == 2


async def test_another_refusal_is_not() -> None:
    async def create() -> str:
        raise APIError(code=400, err_code=10058, description="stream name already in use")

    with pytest.raises(APIError):
        await until_placed(create, "stream S")


async def test_no_answer_is_asked_again() -> None:
    calls: list[int] = []

    async def create() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise nats.errors.TimeoutError
        return "created"

    assert await until_placed(create, "stream S") == "created" and len(calls) == 2
