"""Basic auth (bcrypt) and the HTTPS redirect of a route's middleware, on a real proxy and real HTTP."""

from __future__ import annotations

import base64

import aiohttp
import bcrypt
from zattera.v1 import types_pb2 as pb

from services.proxy.auth import BasicAuth, parse_basic, route_users
from tests.proxy.harness import HOST, Backend, ProxyFactory, Routes, endpoint, http_route, serving


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def bcrypt_hash(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()  # low cost: a fast test


async def status(client: aiohttp.ClientSession, port: int, headers: dict[str, str]) -> int:
    async with client.get(f"http://127.0.0.1:{port}/x?y=1", headers={"Host": HOST, **headers}) as response:
        return response.status


async def test_basic_auth_lets_in_each_listed_user_and_nobody_else(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    backend = Backend("ok")
    middleware = pb.Middleware(basic_auth_username="legacy", basic_auth_password_hash=bcrypt_hash("old"))
    middleware.basic_auth_users.add(username="alice", password_hash=bcrypt_hash("wonderland"))
    middleware.basic_auth_users.add(username="bob", password_hash=bcrypt_hash("builder"))
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(proxy, http_route(HOST, endpoints=[endpoint(backend.addr)], middleware=middleware))
        for username, password in [("alice", "wonderland"), ("bob", "builder"), ("legacy", "old")]:
            assert await status(client, proxy.port, {"Authorization": basic(username, password)}) == 200
        assert await status(client, proxy.port, {"Authorization": basic("alice", "wonderland")}) == 200  # remembered
        assert backend.seen and all("Authorization" not in r.headers for r in backend.seen)  # never the password
        for refused in [{}, {"Authorization": basic("alice", "builder")}, {"Authorization": basic("eve", "x")}]:
            async with client.get(f"http://127.0.0.1:{proxy.port}/", headers={"Host": HOST, **refused}) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"] == 'Basic realm="zattera"'
                assert await response.json() == {"error": "unauthorized"}


async def test_redirect_https_sends_plain_http_to_https_unless_a_terminator_did_tls(
    make_proxy: ProxyFactory, routes: Routes, client
) -> None:
    backend = Backend("ok")
    async with serving(backend):
        proxy = await make_proxy()
        await routes.serve(
            proxy,
            http_route(HOST, endpoints=[endpoint(backend.addr)], middleware=pb.Middleware(redirect_https=True)),
            http_route("plain.example.com", "e2", [endpoint(backend.addr)]),
        )
        url = f"http://127.0.0.1:{proxy.port}/x?y=1"
        async with client.get(url, headers={"Host": HOST}, allow_redirects=False) as response:
            assert response.status == 308
            assert response.headers["Location"] == f"https://{HOST}/x?y=1"
        assert await status(client, proxy.port, {"X-Forwarded-Proto": "https"}) == 200
        async with client.get(url, headers={"Host": "plain.example.com"}, allow_redirects=False) as response:
            assert response.status == 200  # no middleware: not redirected (no TLS listener here)


async def test_malformed_credentials_and_hashes_let_nobody_in() -> None:
    auth = BasicAuth()
    assert parse_basic("Bearer abc") is None and parse_basic("Basic !!!") is None
    assert parse_basic(basic("a", "b:c")) == ("a", "b:c")
    assert not await auth.admits({"a": "not-a-bcrypt-hash"}, basic("a", "not-a-bcrypt-hash"))
    assert route_users(pb.Middleware()) == {}
