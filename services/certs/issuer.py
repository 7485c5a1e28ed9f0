"""Obtaining one certificate over ACME (RFC 8555) with the ``acme`` library, HTTP-01 answered by every proxy.

The library is synchronous (``requests``): each network step runs in a worker thread; publishing the
challenge answers in NATS happens on the event loop in between. The CA's reason for a failure is kept
(``problem detail``), and so is its ``Retry-After``, for the loop's backoff.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
from acme import challenges, client, crypto_util, errors, messages
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from josepy.jwa import ES256
from josepy.jwk import JWK, JWKEC

from shared.errors import ZatteraError

log = logging.getLogger(__name__)
logging.getLogger("acme").setLevel(logging.WARNING)  # its debug log echoes every request and response

T = TypeVar("T")

USER_AGENT = "zattera-certs"
NETWORK_TIMEOUT = 30


class OrderFailed(ZatteraError):
    """An order failed; ``reason`` is the CA's own words where it gave some; ``retry_after`` in seconds."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


def new_private_key_pem() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class _Network(client.ClientNetwork):
    """Remembers the last response (its Retry-After) and verifies the directory's TLS against ``ca_bundle``."""

    def __init__(self, key: JWK, ca_bundle: str, **kwargs: Any) -> None:
        super().__init__(key, alg=ES256, user_agent=USER_AGENT, timeout=NETWORK_TIMEOUT, **kwargs)
        self.ca_bundle = ca_bundle
        self.last_response: requests.Response | None = None

    def _send_request(self, method: str, url: str, *args: Any, **kwargs: Any) -> requests.Response:
        if self.ca_bundle:
            self.verify_ssl = self.ca_bundle  # type: ignore[assignment]  # requests takes a bundle path too
        response = super()._send_request(method, url, *args, **kwargs)
        self.last_response = response
        return response


@dataclass(frozen=True)
class Account:
    key_pem: bytes
    uri: str


PublishAnswer = Callable[[str, str], Awaitable[None]]
WithdrawAnswer = Callable[[str], Awaitable[None]]


class AcmeIssuer:
    """One ACME directory and account; :meth:`issue` obtains a certificate for one hostname."""

    def __init__(self, directory_url: str, email: str, *, ca_bundle: str = "", order_timeout: float = 45.0) -> None:
        self.directory_url = directory_url
        self.email = email
        self.ca_bundle = ca_bundle
        self.order_timeout = order_timeout

    def _client(self, account_key_pem: bytes, uri: str = "") -> tuple[client.ClientV2, _Network]:
        key = JWKEC(key=serialization.load_pem_private_key(account_key_pem, password=None))
        regr = messages.RegistrationResource(body=messages.Registration(), uri=uri) if uri else None
        net = _Network(key, self.ca_bundle, account=regr)
        directory = client.ClientV2.get_directory(self.directory_url, net)
        return client.ClientV2(directory, net), net

    async def register(self) -> Account:
        """A new account key and its registration at the directory."""
        key_pem = new_private_key_pem()

        def go() -> str:
            acme, _ = self._client(key_pem)
            registration = (
                messages.NewRegistration.from_data(email=self.email, terms_of_service_agreed=True)
                if self.email
                else messages.NewRegistration.from_data(terms_of_service_agreed=True)
            )
            regr = acme.new_account(registration)
            return str(regr.uri)

        uri = await self._step(go, None)
        return Account(key_pem, uri)

    async def issue(
        self, hostname: str, account: Account, publish: PublishAnswer, withdraw: WithdrawAnswer
    ) -> tuple[str, bytes]:
        """(chain PEM, private key PEM) for ``hostname``; raises :class:`OrderFailed`."""
        acme, net = await self._step(lambda: self._client(account.key_pem, account.uri), None)
        key_pem = new_private_key_pem()
        csr = crypto_util.make_csr(key_pem, [hostname])
        order = await self._step(lambda: acme.new_order(csr), net)
        tokens: list[str] = []
        try:
            for authz in order.authorizations:
                if authz.body.status == messages.STATUS_VALID:
                    continue  # the CA remembers a recent validation of this name
                challb = next((c for c in authz.body.challenges if isinstance(c.chall, challenges.HTTP01)), None)
                if challb is None:
                    raise OrderFailed(f"the CA offers no HTTP-01 challenge for {authz.body.identifier.value}")
                response, validation = challb.response_and_validation(net.key)
                token = challb.chall.encode("token")
                await publish(token, validation)
                tokens.append(token)
                await self._answer(acme, net, challb, response)
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.order_timeout)
            done = await self._step(lambda: acme.poll_and_finalize(order, deadline), net)
        finally:
            for token in tokens:
                await withdraw(token)
        if not done.fullchain_pem:
            raise OrderFailed("the CA returned no certificate")
        return str(done.fullchain_pem), key_pem

    async def _answer(
        self,
        acme: client.ClientV2,
        net: _Network,
        challb: messages.ChallengeBody,
        response: challenges.ChallengeResponse,
    ) -> None:
        await self._step(lambda: acme.answer_challenge(challb, response), net)

    async def _step(self, fn: Callable[[], T], net: _Network | None) -> T:
        """``fn`` in a worker thread; ACME, validation and network errors become :class:`OrderFailed`."""
        try:
            return await asyncio.to_thread(fn)
        except OrderFailed:
            raise
        except errors.ValidationError as exc:
            raise OrderFailed(validation_reason(exc)) from None
        except messages.Error as exc:
            raise OrderFailed(problem_text(exc), retry_after(net)) from None
        except errors.TimeoutError:
            raise OrderFailed("the CA did not validate the order in time") from None
        except requests.RequestException as exc:
            raise OrderFailed(f"the CA is unreachable ({type(exc).__name__})") from None
        except errors.Error as exc:
            raise OrderFailed(f"ACME error: {exc}") from None


def problem_text(problem: messages.Error) -> str:
    code = problem.code or (problem.typ or "").rsplit(":", 1)[-1]
    detail = problem.detail or problem.description or ""
    return f"{code}: {detail}" if code else detail


def validation_reason(exc: errors.ValidationError) -> str:
    for authzr in exc.failed_authzrs:
        for challb in authzr.body.challenges:
            if challb.error is not None:
                return f"{authzr.body.identifier.value}: {problem_text(challb.error)}"
    return "the CA refused the challenge"


def retry_after(net: _Network | None) -> float | None:
    """The CA's Retry-After on the last response (seconds or an HTTP date), None when absent."""
    if net is None or net.last_response is None:
        return None
    value = net.last_response.headers.get("Retry-After")
    if not value:
        return None
    at = client.ClientV2.retry_after(net.last_response, 0)
    return max((at - datetime.datetime.now()).total_seconds(), 0.0)
