"""The wire contract of ``zattera.activate`` (served by the autoscale service's activator, asked by the
proxy): the error reply and its codes, and the client side.

A request body is an ``ActivateRequest``; the reply is an ``ActivateResponse``, or an error reply: empty
body with the NATS micro service headers ``Nats-Service-Error-Code`` (the code) and ``Nats-Service-Error``
(the message). Codes are gRPC's names as HTTP-like numbers (:data:`INVALID_ARGUMENT` 400, :data:`NOT_FOUND`
404, :data:`ABORTED` 409, :data:`INTERNAL` 500, :data:`UNAVAILABLE` 503).
"""

from __future__ import annotations

from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.subjects import ACTIVATE_SUBJECT

ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"

INVALID_ARGUMENT = 400
NOT_FOUND = 404
ABORTED = 409
INTERNAL = 500
UNAVAILABLE = 503


class ActivateError(ZatteraError):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def request_activation(
    conn: Connection, environment_id: str, node_id: str = "", *, timeout: float = 10.0
) -> cpb.ActivateResponse:
    """The client side (what a proxy calls): raises :class:`ActivateError` on an error reply."""
    request = cpb.ActivateRequest(environment_id=environment_id, node_id=node_id)
    reply = await conn.nc.request(ACTIVATE_SUBJECT, request.SerializeToString(deterministic=True), timeout=timeout)
    headers = reply.headers or {}
    if ERROR_CODE_HEADER in headers:
        raise ActivateError(int(headers[ERROR_CODE_HEADER]), headers.get(ERROR_HEADER, ""))
    return cpb.ActivateResponse.FromString(reply.data)
