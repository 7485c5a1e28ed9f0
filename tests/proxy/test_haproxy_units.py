"""Pure parts of the HAProxy engine: the plan of a snapshot, backend rules, stats samples, certificate
changes (table tests, no processes)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.proxy import haproxy_config, haproxy_rules
from services.proxy.haproxy_certs import changes, digest, pem_problem, self_signed_pem
from services.proxy.haproxy_changes import MAP_REWRITE_ABOVE, hosts_map_commands, server_commands
from services.proxy.haproxy_config import HOLD_BACKEND, IDLE_POOL, NO_ROUTE_BACKEND, Layout, render
from services.proxy.haproxy_ingress import hold_port
from services.proxy.haproxy_plan import backend_name, plan
from services.proxy.haproxy_rules import BACKEND_STAGES, ELSEWHERE, FRONTEND_STAGES, backend_rules
from services.proxy.haproxy_stats import HAProxySampler, merge_samples
from services.proxy.pipeline import ORDER
from tests.proxy.harness import endpoint, http_route


def planned(*routes: cpb.HTTPRoute, cache: dict | None = None):  # type: ignore[type-arg]
    return plan(cpb.RouteSnapshot(http_routes=list(routes)), node_id="n1", hold_timeout=60, cache=cache)


def test_hosts_paths_and_the_python_handler() -> None:
    warm = http_route("A.example.com", "e1", [endpoint("10.0.0.1:80", "a1")])
    result = planned(
        warm,
        http_route("cold.example.com", "e2", scale_to_zero=True),
        http_route(
            "auth.example.com",
            "e3",
            [endpoint("10.0.0.2:80")],
            middleware=pb.Middleware(basic_auth_username="u", basic_auth_password_hash="$2b$04$x"),
        ),
        http_route("p.example.com", "e4", [endpoint("10.0.0.3:80")]),
        http_route("p.example.com", "e5", [endpoint("10.0.0.4:80")], prefix="/api"),
        http_route("p.example.com", "e6", [endpoint("10.0.0.5:80")], prefix="nope"),
    )
    assert result.hosts == {
        "a.example.com": backend_name(warm),
        "cold.example.com": HOLD_BACKEND,
        "auth.example.com": HOLD_BACKEND,
    }
    assert [key for key, _ in result.paths] == ["p.example.com/api", "p.example.com/"]  # longest first
    assert {b.env_id for b in result.backends.values()} == {"e1", "e2", "e4", "e5", "e6"}  # cold keeps one; auth none
    assert result.backends[backend_name(warm)].servers[0].weight == 101  # same node: the tie-break weight


def test_going_cold_and_warm_is_a_runtime_change_but_sticky_servers_are_structure() -> None:
    cache: dict = {}  # type: ignore[type-arg]
    cold = planned(http_route("h", "e1", scale_to_zero=True), cache=cache)
    warm = planned(http_route("h", "e1", [endpoint("10.0.0.1:80")], scale_to_zero=True), cache=cache)
    assert warm.same_structure(cold) and warm.hosts["h"] != HOLD_BACKEND
    sticky = pb.Middleware(sticky_sessions=True)
    one = planned(http_route("h", "e1", [endpoint("10.0.0.1:80")], middleware=sticky))
    two = planned(http_route("h", "e1", [endpoint("10.0.0.2:80")], middleware=sticky))
    assert not one.same_structure(two)
    assert not warm.same_structure(planned(http_route("h", "e1", [endpoint("10.0.0.1:80")], max_concurrency=3)))


@pytest.mark.parametrize(
    ("route", "expected"),
    [
        (http_route(middleware=pb.Middleware(ip_allowlist=["bad"])), "return status 403"),
        (http_route(middleware=pb.Middleware(ip_allowlist=["10.0.0.0/8"])), "unless { src 10.0.0.0/8 }"),
        (http_route(middleware=pb.Middleware(redirect_https=True)), "redirect scheme https code 308"),
        (http_route(rate_limit=pb.RateLimit(requests_per_second=5, burst=8)), "sc_http_req_rate(0) gt 8"),
        (http_route(middleware=pb.Middleware(max_body_bytes=10)), "req.hdr_val(content-length) gt 10"),
        (http_route(middleware=pb.Middleware(sticky_sessions=True)), "cookie zt_sticky insert"),
        (http_route(middleware=pb.Middleware(compress=True)), "compression algo gzip"),
        (http_route(max_concurrency=4), "timeout queue 60000ms"),
    ],
)
def test_backend_rules(route: cpb.HTTPRoute, expected: str) -> None:
    assert any(expected in rule for rule in backend_rules(route, 60))


STAGE_MARKERS = {
    "acme_challenge": "path_beg /.well-known/acme-challenge/",
    "route_match": "hosts.map",
    "allowlist": "return status 403",
    "https_redirect": "redirect scheme https",
    "rate_limit": "return status 429",
    "body_cap": "return status 413",
    "endpoint_choice": "cookie zt_sticky insert",
}
"""A line of the rendered configuration that only each stage's rules write."""


def _stages_in_rendered_order(tmp_path: Path) -> list[str]:
    middleware = pb.Middleware(
        ip_allowlist=["10.0.0.0/8"], redirect_https=True, max_body_bytes=10, sticky_sessions=True
    )
    route = http_route(
        "h",
        "e1",
        [endpoint("10.0.0.1:80", "a1")],
        middleware=middleware,
        rate_limit=pb.RateLimit(requests_per_second=5),
    )
    text = render(planned(route), Layout(tmp_path, "127.0.0.1:8080", "127.0.0.1:9", 60, 5))
    seen = [stage for line in text.splitlines() for stage, marker in STAGE_MARKERS.items() if marker in line]
    assert sorted(seen) == sorted(STAGE_MARKERS), seen  # each stage's marker exactly once
    return seen


def test_every_pipeline_stage_has_one_place_in_haproxy() -> None:
    placed = [*FRONTEND_STAGES, *BACKEND_STAGES, *ELSEWHERE]
    assert sorted(placed) == sorted(ORDER)  # a new Python middleware needs its HAProxy rules (or a reason)
    frontend = [ORDER.index(stage) for stage in FRONTEND_STAGES]
    backend = [ORDER.index(stage) for stage in BACKEND_STAGES]
    assert max(frontend) < min(backend)  # a frontend runs before the backend it picks


def test_haproxy_rules_follow_the_python_pipeline_order(tmp_path: Path) -> None:
    assert _stages_in_rendered_order(tmp_path) == [stage for stage in ORDER if stage in STAGE_MARKERS]


def test_haproxy_rule_order_is_derived_from_the_pipeline_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = [stage for stage in ORDER if stage in BACKEND_STAGES]
    reordered = (*FRONTEND_STAGES, *reversed(backend), *ELSEWHERE)
    monkeypatch.setattr(haproxy_config, "ORDER", reordered)
    monkeypatch.setattr(haproxy_rules, "ORDER", reordered)
    assert _stages_in_rendered_order(tmp_path) == [stage for stage in reordered if stage in STAGE_MARKERS]


def test_render_has_every_backend_and_the_tls_listener(tmp_path: Path) -> None:
    layout = Layout(tmp_path, "0.0.0.0:8080", "127.0.0.1:9", 60, 5, tls_bind="0.0.0.0:8443")
    text = render(planned(http_route("h", "e1", [endpoint("10.0.0.1:80", "a1")], max_concurrency=2)), layout)
    assert "bind 0.0.0.0:8443 ssl crt" in text and "alpn h2,http/1.1" in text
    assert f"server s_a1 10.0.0.1:80 weight 101 {IDLE_POOL} maxconn 2" in text
    hold = text[text.index("\nbackend hold\n") :].split("\n\n")[0]
    assert "server python 127.0.0.1:9" in hold
    assert "retries 10" in hold and "timeout connect 1s" in hold  # a request waits for a restarting proxy
    assert "retry-on conn-failure empty-response" in hold and "disable-l7-retry if !METH_GET" in hold
    challenge = text.index("use_backend hold if { path_beg /.well-known/acme-challenge/ }")  # to the Python answerer
    assert challenge < text.index(f"map({layout.hosts_map})")  # whatever the host
    assert f"default_backend {NO_ROUTE_BACKEND}" in text and "no route for host" in text


def test_the_frontend_runs_only_what_some_route_needs(tmp_path: Path) -> None:
    """The path map and the HTTPS variable cost every request something: rendered only when a route uses
    them, and gaining or losing the first such route is a reload."""
    layout = Layout(tmp_path, "0.0.0.0:8080", "127.0.0.1:9", 60, 5)
    plain = planned(http_route("h", "e1", [endpoint("10.0.0.1:80", "a1")]))
    assert "map_beg" not in render(plain, layout) and "txn.https" not in render(plain, layout)
    prefixed = planned(http_route("h", "e1", [endpoint("10.0.0.1:80", "a1")], prefix="/api"))
    assert f"map_beg({layout.paths_map})" in render(prefixed, layout)
    assert not plain.same_structure(prefixed) and not prefixed.same_structure(plain)
    redirecting = planned(
        http_route("h", "e2", [endpoint("10.0.0.1:80")], middleware=pb.Middleware(redirect_https=True))
    )
    assert "http-request set-var(txn.https) bool(1) if { ssl_fc }" in render(redirecting, layout)


def row(backend: str, stot: int, errors: int = 0, scur: int = 0, qcur: int = 0, lastsess: int = -1) -> dict[str, str]:
    return {
        "pxname": backend,
        "svname": "BACKEND",
        "stot": str(stot),
        "hrsp_5xx": str(errors),
        "scur": str(scur),
        "qcur": str(qcur),
        "ttime": "7",
        "lastsess": str(lastsess),
    }


def test_sampler_deltas_resets_and_several_backends_of_one_env() -> None:
    sampler = HAProxySampler(now=100.0)
    envs = {"b1": "e1", "b2": "e1"}
    first = sampler.sample([row("b1", 10, scur=2, lastsess=1), row("b2", 10, errors=5, qcur=3)], envs, 102.0)
    assert (first["e1"].inflight, first["e1"].held, first["e1"].rps) == (2, 3, 10.0)
    assert first["e1"].error_rate == 0.25 and first["e1"].latency_p50_ms == 7
    assert first["e1"].last_request_at.seconds == 101
    after_reload = sampler.sample([row("b1", 4), row("b2", 10, errors=5)], envs, 104.0)
    assert after_reload["e1"].rps == 2.0  # b1 restarted from zero: its 4 count; b2 did nothing


def test_merge_samples_adds_counts_and_weights_errors() -> None:
    haproxy = {"e1": cpb.ProxySample(inflight=2, rps=30, error_rate=0.0, latency_p50_ms=3)}
    python = {"e1": cpb.ProxySample(held=4, rps=10, error_rate=1.0), "e2": cpb.ProxySample(held=1)}
    merged = merge_samples(haproxy, python)
    assert (merged["e1"].inflight, merged["e1"].held, merged["e1"].rps) == (2, 4, 40)
    assert merged["e1"].error_rate == 0.25 and merged["e1"].latency_p50_ms == 3 and merged["e2"].held == 1


def test_certificate_changes() -> None:
    certs, crt_list = Path("/c"), Path("/l")
    commands, written, gone = changes(
        {"new": "N", "same": "S", "changed": "C2"},
        {"same": digest("S"), "changed": digest("C1"), "old": digest("O")},
        certs,
        crt_list,
    )
    assert written == {"changed": "C2", "new": "N"} and gone == ["old"]
    assert commands == [
        "set ssl cert /c/changed.pem <<\nC2\n\n",
        "commit ssl cert /c/changed.pem",
        "new ssl cert /c/new.pem",
        "set ssl cert /c/new.pem <<\nN\n\n",
        "commit ssl cert /c/new.pem",
        "add ssl crt-list /l /c/new.pem",
        "del ssl crt-list /l /c/old.pem",
        "del ssl cert /c/old.pem",
    ]


def test_sampler_counts_responses_per_env_and_status_class_for_the_metrics() -> None:
    sampler = HAProxySampler(now=0.0)
    backend = {**row("b1", 3), "hrsp_2xx": "3"}
    hold = {**row("hold", 2), "hrsp_2xx": "2"}
    frontend = {"pxname": "ingress", "svname": "FRONTEND", "stot": "9", "hrsp_2xx": "5", "hrsp_4xx": "1"}
    no_route = {**row(NO_ROUTE_BACKEND, 1), "hrsp_4xx": "1"}  # answers the frontend's unknown hosts
    sampler.sample([frontend, backend, hold, no_route], {"b1": "e1"}, 1.0)
    assert {(r.env_id, r.status_class, r.count) for r in sampler.responses} == {("e1", 2, 3), ("", 4, 1)}
    sampler.sample([frontend, backend, hold], {"b1": "e1"}, 2.0)
    assert sampler.responses == []  # nothing new


def test_pem_problems_are_named_before_anything_is_written(tmp_path: Path) -> None:
    good = self_signed_pem("a.example.com")
    other_key = self_signed_pem("b.example.com").split("-----END CERTIFICATE-----\n", 1)[1]
    certificate_only = good.split("-----END CERTIFICATE-----\n", 1)[0] + "-----END CERTIFICATE-----\n"
    mangled = certificate_only.replace(certificate_only[80:120], "A" * 40) + other_key
    encrypted = certificate_only + (
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIGbMFcGCSqGSIb3DQEFDTBKMCkGCSqGSIb3DQEFDDAcBAhmZ2l2ZW4xMjMCAggA\n"
        "-----END ENCRYPTED PRIVATE KEY-----\n"
    )
    assert pem_problem(good, tmp_path) is None
    chain = good.split("-----END CERTIFICATE-----\n", 1)
    issuer = self_signed_pem("ca.example.com").split("-----BEGIN PRIVATE")[0]
    chain_pem = chain[0] + "-----END CERTIFICATE-----\n" + issuer
    assert pem_problem(chain_pem + chain[1], tmp_path) is None  # a leaf, its issuer's certificate, the key
    assert pem_problem("garbage", tmp_path) == "no PEM certificate in it"
    assert pem_problem(mangled, tmp_path) == "no PEM certificate in it"
    assert pem_problem(certificate_only, tmp_path) == "no PEM private key in it"
    assert pem_problem(certificate_only + other_key, tmp_path) == "its private key does not match its first certificate"
    assert pem_problem(encrypted, tmp_path) == "its private key cannot be read (encrypted or malformed)"
    assert list(tmp_path.iterdir()) == []  # the key written to check it is gone


def test_the_fallback_certificate_is_made_outside_the_proxy_process(tmp_path: Path) -> None:
    path = tmp_path / "fallback.pem"
    probe = (
        "import sys; from pathlib import Path; from services.proxy.haproxy_certs import ensure_fallback; "
        f"ensure_fallback(Path({str(path)!r})); print('cryptography' in sys.modules)"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert loaded.strip() == "False"
    assert pem_problem(path.read_text(), tmp_path) is None
    assert path.stat().st_mode & 0o777 == 0o600


def test_runtime_commands_add_a_server_drain_a_leaving_one_and_bring_a_drained_one_back() -> None:
    one = planned(http_route("h", "e1", [endpoint("10.0.0.1:80", "a1")]))
    two = planned(http_route("h", "e1", [endpoint("10.0.0.2:80", "a2")]))
    name = backend_name(http_route("h", "e1"))
    draining: set[tuple[str, str]] = set()
    arriving, leaving = server_commands(one, two, draining, iter([1_000_000]))
    assert arriving[0].startswith(f"add server {name}/s_a2 10.0.0.2:80 weight 101") and "id 1000000" in arriving[0]
    assert arriving[1:] == [f"enable server {name}/s_a2"]
    assert leaving == [f"disable server {name}/s_a1"] and draining == {(name, "s_a1")}
    back, gone = server_commands(two, one, draining, iter([]))  # a1 back before its deletion: re-enabled
    assert f"enable server {name}/s_a1" in back and (name, "s_a1") not in draining
    assert gone == [f"disable server {name}/s_a2"]


def test_host_map_changes_go_entry_by_entry_until_so_many_that_a_rewrite_is_cheaper(tmp_path: Path) -> None:
    hosts_map = tmp_path / "hosts.map"
    few = planned(http_route("a", "e1", [endpoint("10.0.0.1:80", "a1")]))
    assert hosts_map_commands(hosts_map, planned(), few) == [f"add map {hosts_map} a {backend_name(http_route('a'))}"]
    many = planned(*(http_route(f"h{i}", f"e{i}") for i in range(MAP_REWRITE_ABOVE + 1)))
    assert hosts_map_commands(hosts_map, many, planned()) is None  # more than the bound go: rewrite whole


def test_the_python_handler_keeps_its_port_for_the_next_proxy_process_while_it_is_free(tmp_path: Path) -> None:
    """An HAProxy that outlived a proxy process sends to the port recorded: the next process takes it again."""
    recorded = tmp_path / "haproxy" / "hold.port"
    first = hold_port(recorded)
    assert recorded.read_text() == f"{first}\n"
    assert hold_port(recorded) == first
    with socket.create_server(("127.0.0.1", first)):  # taken by another program meanwhile: a new port
        second = hold_port(recorded)
    assert second != first and recorded.read_text() == f"{second}\n"
    recorded.write_text("not a port")
    assert 0 < hold_port(recorded) < 65536
